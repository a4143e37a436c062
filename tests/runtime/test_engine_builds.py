"""Engine builds on a node (engines/cache_dir.py): every build lives under its accelerator's folder,
``<engine cache dir>/<accelerator>/<group>/<build>/``, in the layout the node agent lists and copies
(embedfleet/operator/cache/engines.py), and the runtime reports where the build it loads came from: ``built``
by this process, ``cache`` (made earlier on this node), ``peer`` (copied in by the node agent, which leaves
its SOURCE_RECORD inside), as ``embedfleet_engine_source_info`` and in GET /load's ``startup``.

A real int8 build of a tiny random RoBERTa embedder (the one test_int8_families.py shows the gate keeps)
is made once and loaded three times."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram

from embedfleet.operator.cache.engines import (
    ACCELERATOR,
    PART,
    SOURCE_RECORD,
    Build,
    cpu_accelerator,
    gpu_accelerator,
    list_builds,
)
from embedfleet.runtime.cold_start import BUCKETS, ColdStart
from embedfleet.runtime.engines.cache_dir import (
    BuildSource,
    build_source,
    check_part,
    default_engine_cache_dir,
    engine_root,
)
from embedfleet.runtime.engines.trtllm_engine import EngineKey, engine_path
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.models.spec import ModelSpec, load_spec
from embedfleet.runtime.service import engine_build_source
from tests.tiny_models import encoder_family_embedder

THREADS = 2
PEER = {"source": "peer", "from": "http://10.0.0.7:8090", "seconds": 1.5, "bytes": 1234,
        "at": "2026-11-27T06:00:00Z"}
TRT_KEY = EngineKey("sha256:" + "ab" * 32, "NVIDIA H100 80GB HBM3", "bfloat16", "1.0.0", 16384, 512, 64)


@pytest.fixture(scope="module")
def roberta(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    return load_spec(encoder_family_embedder(tmp_path_factory.mktemp("tiny"), "roberta", 0))


# ---------------------------------------------------------------- pure: where builds go


def test_builds_go_under_the_accelerator_folder(tmp_path: Path) -> None:
    model = tmp_path / "models" / "sha256-abc"
    model.mkdir(parents=True)
    assert engine_root(tmp_path / "engines", model, "cpu-x86_64-avx2") == tmp_path / "engines" / "cpu-x86_64-avx2"
    # no --engine-cache-dir: the default root, then the accelerator
    assert engine_root(None, model, "cuda-nvidia-h100-80gb-hbm3") == \
        default_engine_cache_dir(model) / "cuda-nvidia-h100-80gb-hbm3"
    assert ACCELERATOR.match(cpu_accelerator())
    assert engine_root(tmp_path, model, cpu_accelerator()).name == cpu_accelerator()
    for bad in ("", "..", "x86", "cpu/../x", ".cpu-x86_64-avx2"):
        with pytest.raises(ValueError, match="accelerator"):
            engine_root(tmp_path, model, bad)


def test_build_folder_names_are_what_the_node_agent_lists() -> None:
    assert check_part("sha256-0123456789abcdef") == "sha256-0123456789abcdef"
    for bad in (".int8-cpu-x.lock", "a/b", "", "x" * 200):
        with pytest.raises(ValueError, match="build folder"):
            check_part(bad)


def test_trtllm_builds_go_under_the_gpu_folder(roberta: ModelSpec, tmp_path: Path) -> None:
    spec = replace(roberta, name="bert-embed")
    key = replace(TRT_KEY, model_digest=spec.digest)
    acc = gpu_accelerator(key.gpu_name)
    assert acc == "cuda-nvidia-h100-80gb-hbm3"
    path = engine_path(engine_root(tmp_path, spec.path, acc), spec, key)
    assert path.relative_to(tmp_path).parts == (acc, f"bert-embed-{spec.digest[7:23]}", key.dirname())
    assert all(PART.match(p) for p in path.relative_to(tmp_path).parts[1:])
    # a served name with a slash is one folder, not two
    org = replace(spec, name="org/model")
    assert engine_path(tmp_path, org, key).parent.name == f"org-model-{spec.digest[7:23]}"


def test_where_a_build_came_from(tmp_path: Path) -> None:
    build = tmp_path / "b"
    build.mkdir()
    assert build_source(build, built=True) == BuildSource("built", build)
    assert build_source(build, built=False) == BuildSource("cache", build)
    for other in ("not json", "[]", '{"source": "origin"}', '{"from": "http://x"}'):
        (build / SOURCE_RECORD).write_text(other)
        assert build_source(build, built=False).source == "cache", other
    (build / SOURCE_RECORD).write_text(json.dumps(PEER))
    found = build_source(build, built=False)
    assert found == BuildSource("peer", build, "http://10.0.0.7:8090")
    assert found.as_dict() == {"source": "peer", "path": str(build), "from": "http://10.0.0.7:8090"}
    assert found.describe() == "fetched from a peer (http://10.0.0.7:8090)"
    assert build_source(build, built=True).source == "built"  # this process's own build says so
    (build / SOURCE_RECORD).write_text('{"source": "peer"}')
    assert build_source(build, built=False).describe() == "fetched from a peer (unknown)"


# ---------------------------------------------------------------- a real int8 build, loaded three times


def test_an_int8_build_is_kept_per_cpu_class_and_says_where_it_came_from(
        roberta: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    from embedfleet.runtime.engines import int8_cpu
    from embedfleet.runtime.engines.int8_cpu import Int8CpuEngine, build_int8_engine

    root = tmp_path / "engines"
    first = build_int8_engine(roberta, num_threads=THREADS, cache_root=root)
    assert isinstance(first, Int8CpuEngine)
    found = first.build_source
    assert found is not None and found.source == "built"
    rel = found.path.relative_to(root).parts
    assert rel[0] == cpu_accelerator() and len(rel) == 3
    assert rel[1] == f"sha256-{roberta.digest[7:23]}" and rel[2].startswith("int8-cpu-")
    # exactly what the node agent would list and offer (no lock, no temporary folder)
    assert list_builds(root) == [Build(*rel)]
    assert engine_build_source(first) == found

    def forbidden(*args, **kwargs):
        raise AssertionError("a finished build must not be made again")

    monkeypatch.setattr(int8_cpu, "quantize", forbidden)  # judged again on its probe texts, not quantised
    again = build_int8_engine(roberta, num_threads=THREADS, cache_root=root)
    assert again.build_source == BuildSource("cache", found.path)

    (found.path / SOURCE_RECORD).write_text(json.dumps(PEER))  # as the agent leaves a build it copied
    fetched = build_int8_engine(roberta, num_threads=THREADS, cache_root=root)
    assert fetched.build_source == BuildSource("peer", found.path, PEER["from"])
    # each start judged the build again on its probe texts: the same build, the same measurement
    assert isinstance(fetched, Int8CpuEngine) and fetched.int8_gate.passed and fetched.int8_gate.measured_on == "probe"
    assert fetched.int8_gate.min_cosine == pytest.approx(again.int8_gate.min_cosine, abs=1e-6)


def test_engines_that_build_nothing_report_nothing() -> None:
    class Plain:  # a float32/bf16 torch engine has no build_source
        pass

    assert engine_build_source(Plain()) is None  # type: ignore[arg-type]


# ---------------------------------------------------------------- the report: /metrics and GET /load's startup


def test_the_engine_source_is_a_metric_a_startup_entry_and_a_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = RuntimeMetrics()
    cold = metrics.cold_start
    cold.engine_loaded("plain", 0.5)  # a torch engine: no build
    with caplog.at_level(logging.INFO, logger="embedfleet.runtime.cold_start"):
        cold.engine_build("built", BuildSource("built", tmp_path / "a"))
        cold.engine_build("kept", BuildSource("cache", tmp_path / "b"))
        cold.engine_build("copied", BuildSource("peer", tmp_path / "c", "http://10.0.0.7:8090"))
    sample = metrics.registry.get_sample_value
    assert sample("embedfleet_engine_source_info", {"model": "built", "source": "built"}) == 1
    assert sample("embedfleet_engine_source_info", {"model": "kept", "source": "cache"}) == 1
    assert sample("embedfleet_engine_source_info", {"model": "copied", "source": "peer"}) == 1
    assert sample("embedfleet_engine_source_info", {"model": "plain", "source": "built"}) is None
    models = cold.report()["models"]
    assert "engine" not in models["plain"]
    assert models["built"]["engine"] == {"source": "built", "path": str(tmp_path / "a")}
    assert models["copied"]["engine"] == {"source": "peer", "path": str(tmp_path / "c"),
                                          "from": "http://10.0.0.7:8090"}
    json.dumps(cold.report())  # what GET /load serves
    lines = [r.getMessage() for r in caplog.records]
    assert f"built: engine build built at {tmp_path / 'a'}" in lines
    assert f"kept: engine build reused from this node at {tmp_path / 'b'}" in lines
    assert f"copied: engine build fetched from a peer (http://10.0.0.7:8090) at {tmp_path / 'c'}" in lines


def test_a_recorder_without_the_gauge_still_reports() -> None:
    r = CollectorRegistry()
    cold = ColdStart(Histogram("h_seconds", "h", ["phase"], buckets=BUCKETS, registry=r),
                     Gauge("w_info", "w", ["model", "source"], registry=r))
    cold.engine_build("m", BuildSource("cache", Path("/x")))
    assert cold.report()["models"]["m"]["engine"]["source"] == "cache"
