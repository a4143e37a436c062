"""A runtime's own cold start (runtime/embedfleet/runtime/cold_start.py): where its weights came from, and
each phase's seconds, in /metrics and in GET /load's `startup`, from a real `embedfleet serve`.

The served process loads the embedded default model twice: as `mini`, from its package directory (in the
image), and as `cached`, from a directory laid out as `embedfleet cache pull` leaves a pod's own copy
(`.ready` and a `.source.json` saying a peer sent it in 7.5 s). The operator's reader of that section
(operator/cold_start.py) reads the same live answer.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.cold_start import runtime_phases, weights_source
from embedfleet.operator.handlers.cold_start import read_startup
from embedfleet.runtime.cold_start import (
    READY_MARKER,
    SOURCE_RECORD,
    SOURCES,
    classify_weights,
    parse_record,
    process_age_s,
    read_weights_source,
)
from embedfleet.runtime.settings import default_model_dir
from tests.procs import RuntimeServer, start_runtime

PEER = json.dumps({"source": "peer", "from": "http://10.0.0.7:8090", "seconds": 7.5, "bytes": 90_000_000,
                   "at": "2026-11-27T06:00:00Z"})


def entry(root: Path, name: str, record: str | None = None, model: Path | None = None) -> Path:
    """A verified cache entry as `cache pull` publishes it: the model's files (linked), `.ready`, a record."""
    path = root / name
    path.mkdir()
    for item in (model or default_model_dir()).iterdir():
        (path / item.name).symlink_to(item)
    (path / ".ready").write_text("sha256:" + "ab" * 32 + "\n")
    if record is not None:
        (path / ".source.json").write_text(record)
    return path


# ---------------------------------------------------------------- pure: where the weights came from


def test_records_are_read_tolerantly() -> None:
    assert parse_record(PEER) == ("peer", 7.5)
    assert parse_record('{"source": "origin"}') == ("origin", None)
    for bad in (None, "", "not json", "[]", '{"source": "ftp", "seconds": 1}', '{"source": "peer", "seconds": -1}',
                '{"source": "peer", "seconds": "7"}', '{"source": "peer", "seconds": true}',
                '{"source": "peer", "seconds": NaN}'):
        assert parse_record(bad) is None, bad


def test_each_layout_is_classified() -> None:
    assert classify_weights(False, False, None, None).source == "in-image"
    assert classify_weights(False, True, None, None) == classify_weights(False, True, None, "garbage")
    assert classify_weights(False, True, None, None).source == "downloaded"
    assert classify_weights(False, True, None, PEER).as_dict() == {"source": "peer", "seconds": 7.5}
    hit = classify_weights(True, True, None, PEER)  # a link to the node's entry: the pod waited for nothing
    assert hit.as_dict() == {"source": "cache", "seconds": 0.0, "cached_from": "peer"}
    assert classify_weights(True, False, None, None).source == "in-image"  # a link, but not a cache entry
    beside = '{"source": "cache", "seconds": 0.2}'
    assert classify_weights(True, True, beside, PEER).as_dict() == {"source": "cache", "seconds": 0.2}


@given(is_link=st.booleans(), verified=st.booleans(), beside=st.one_of(st.none(), st.text(max_size=80)),
       inside=st.one_of(st.none(), st.text(max_size=80), st.just(PEER)))
def test_any_record_gives_a_known_source_and_a_sane_time(is_link, verified, beside, inside) -> None:
    found = classify_weights(is_link, verified, beside, inside)
    assert found.source in SOURCES
    assert found.seconds is None or (math.isfinite(found.seconds) and found.seconds >= 0)


def test_directories_on_disk(tmp_path: Path) -> None:
    node = entry(tmp_path, "node-entry", PEER)
    link = tmp_path / "sha256-link"
    link.symlink_to(node, target_is_directory=True)
    assert read_weights_source(link).as_dict() == {"source": "cache", "seconds": 0.0, "cached_from": "peer"}
    assert read_weights_source(node).as_dict() == {"source": "peer", "seconds": 7.5}
    assert read_weights_source(entry(tmp_path, "bare")).source == "downloaded"
    assert read_weights_source(entry(tmp_path, "broken", "{oops")).source == "downloaded"
    (tmp_path / "bare.source.json").write_text('{"source": "origin", "seconds": 31}')
    assert read_weights_source(tmp_path / "bare").as_dict() == {"source": "origin", "seconds": 31.0}
    assert read_weights_source(default_model_dir()).as_dict() == {"source": "in-image", "seconds": 0.0}
    assert read_weights_source(tmp_path / "missing").source == "in-image"


def test_process_age_is_the_kernels() -> None:
    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[RuntimeServer, float]:
    cached = entry(tmp_path_factory.mktemp("cache"), "sha256-" + "ab" * 32, PEER)
    before = time.time()
    srv = start_runtime("--model", f"mini={default_model_dir()}", "--model", f"cached={cached}")
    yield srv, before
    srv.stop()


def startup(srv: RuntimeServer) -> dict:
    answer = httpx.get(f"{srv.url}/load", timeout=10)
    assert answer.status_code == 200
    return answer.json()["startup"]


def test_each_phase_is_in_the_load_answer_and_in_metrics(served: tuple[RuntimeServer, float]) -> None:
    srv, before = served
    report = startup(srv)
    started = time.mktime(time.strptime(report["process_started"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    assert before - 1.5 <= started <= before + 5, (before, report["process_started"])
    assert report["models"]["mini"]["weights"] == {"source": "in-image", "seconds": 0.0}
    assert report["models"]["cached"]["weights"] == {"source": "peer", "seconds": 7.5}
    assert report["weights_source"] == "in-image,peer"
    phases = report["phases"]
    assert set(phases) == {"weights", "engine_load", "warmup", "ready"}, phases  # no answer yet, no digest
    assert phases["weights"] == 7.5
    per_model = [m["engine_load"] + m["warmup"] for m in report["models"].values()]
    assert all(m["engine_load"] > 0 and m["warmup"] > 0 for m in report["models"].values())
    assert phases["ready"] >= sum(per_model)  # ready counts from process start: loading is inside it
    for phase, count in (("weights", 2), ("engine_load", 2), ("warmup", 2), ("ready", 1), ("first_request", 0)):
        assert srv.metric("embedfleet_cold_start_seconds_count", phase=phase) == count, phase
    assert srv.metric("embedfleet_cold_start_seconds_sum", phase="weights") == 7.5
    assert srv.metric("embedfleet_weights_source_info", model="cached", source="peer") == 1
    assert srv.metric("embedfleet_weights_source_info", model="mini", source="in-image") == 1
    # what the operator's Event will say of this runtime, read the way its handler reads a Ready pod
    read = read_startup({"metadata": {"name": "p"}, "spec": {"containers": [{"ports": [{"name": "http",
                         "containerPort": srv.port}]}]}, "status": {"phase": "Running", "podIP": "127.0.0.1",
                         "conditions": [{"type": "Ready", "status": "True"}]}}, 8080)
    assert read is not None and runtime_phases(read) == phases and weights_source(read) == "in-image,peer"


def test_the_first_answer_is_recorded_once(served: tuple[RuntimeServer, float]) -> None:
    srv, _ = served
    with srv.client() as c:
        assert c.post("/v1/embeddings", json={"model": "nobody", "input": "x"}).status_code == 404  # not an answer
        assert "first_request" not in startup(srv)["phases"]
        assert c.post("/v1/embeddings", json={"model": "mini", "input": "first"}).status_code == 200
        first = startup(srv)["phases"]["first_request"]
        assert c.post("/v1/embeddings", json={"model": "cached", "input": "second"}).status_code == 200
    after = startup(srv)["phases"]
    assert after["first_request"] == first >= after["ready"]
    assert srv.metric("embedfleet_cold_start_seconds_count", phase="first_request") == 1


def test_an_entry_the_cache_pulled_is_read_as_its_record_says(tmp_path: Path) -> None:
    """The record `embedfleet cache pull` itself writes (a file:// source: `origin`), and the names both sides use."""
    from embedfleet.operator.cache import digest
    from embedfleet.operator.cache.pull import link_node_entry, pull

    assert (digest.SOURCE_RECORD, digest.READY_MARKER) == (SOURCE_RECORD, READY_MARKER)
    source = tmp_path / "weights"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"w" * 4096)
    pinned = digest.tree_digest(source)
    pulled = pull(source.as_uri(), pinned, tmp_path / "node", retries=0).path
    found = read_weights_source(pulled)
    assert found.source == "origin" and found.seconds is not None and 0 <= found.seconds < 60
    # a later pod on that node links the node's entry: a cache hit, nothing waited for
    linked = link_node_entry(pulled, pinned, tmp_path / "pod")
    assert read_weights_source(linked).as_dict() == {"source": "cache", "seconds": 0.0, "cached_from": "origin"}
