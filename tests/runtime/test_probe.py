"""Revisions at the runtime: the start-up probe and its fingerprint, `<served>@rN` names, pinning to a vector
space (409), the revision headers, and drift monitoring against a reference; real servers over sockets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from embedfleet.compat import probe_set
from embedfleet.compat.gate import ProbeOutputs, compare
from embedfleet.runtime.core.probe import SPARSE_BUCKETS
from tests.procs import RuntimeServer, start_runtime
from tests.runtime.output_models import COLBERT_DIM, build_colbert, build_dense, build_splade
from tests.tiny_models import build_all

PROBE = probe_set.load()
HEADER = "x-embedfleet-vector-space"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe-models")
    models = build_all(root)
    models["dense"] = build_dense(root)  # an embedder of the same dimension as bert-embed, other weights
    models["splade"] = build_splade(root)
    models["colbert"] = build_colbert(root)
    return models


@pytest.fixture(scope="module")
def embed_a(tiny) -> RuntimeServer:
    """bert-embed in float32: the revision the other tests compare with."""
    srv = start_runtime("--model", f"emb={tiny['bert-embed']}")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def multi(tiny) -> RuntimeServer:
    """Every task in one server, as revision r1 (so one vector space, `r1`, for all of them)."""
    flags = ["--revision", "r1"]
    for name in ("bert-embed", "bert-rerank", "bert-classify", "splade", "colbert"):
        flags += ["--model", f"{name}={tiny[name]}"]
    srv = start_runtime(*flags)
    yield srv
    srv.stop()


def card(srv: RuntimeServer, model: str) -> dict:
    cards = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]
    return next(c for c in cards if c["id"] == model)


def probe(srv: RuntimeServer, model: str, **params) -> dict:
    r = httpx.get(f"{srv.url}/v1/models/{model}/probe", params=params, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def outputs(body: dict) -> ProbeOutputs:
    return ProbeOutputs.from_json(body)


def wait_for(check, what: str, timeout: float = 90):
    """Poll `check()` until it returns something truthy (returned) or `timeout` passes (fails naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}")


def test_fingerprint_is_stable_across_starts_and_differs_for_other_weights(tiny, embed_a, runtime_factory):
    again = runtime_factory("--model", f"emb={tiny['bert-embed']}")
    other = runtime_factory("--model", f"emb={tiny['dense']}")
    first, second, third = card(embed_a, "emb"), card(again, "emb"), card(other, "emb")
    assert first["fingerprint"].startswith("sha256:") and len(first["fingerprint"]) == 7 + 64
    assert first["fingerprint"] == second["fingerprint"]
    assert first["fingerprint"] != third["fingerprint"]
    assert first["probe_set"] == PROBE.version
    # no --revision, no --vector-space: the space is named after the model files (not the fingerprint,
    # which two processes of one model can round apart)
    assert first["revision"] is None
    assert first["vector_space"].startswith("weights-") and first["vector_space"] == second["vector_space"]
    assert first["vector_space"] != third["vector_space"]
    body = probe(embed_a, "emb")
    assert body["fingerprint"] == first["fingerprint"] == body["outputs_fingerprint"]
    assert body["vector_space"] == first["vector_space"]
    # the drift gate over the served outputs: the same weights pass, other weights are blocked
    same = compare(outputs(body), outputs(probe(again, "emb")))
    assert same.passed and same.min_cosine >= 0.9999, same.message
    changed = compare(outputs(body), outputs(probe(other, "emb")))
    assert not changed.passed and changed.min_cosine < 0.999, changed.message
    print(f"same weights: {same.message}; other weights: {changed.message}")


def test_bfloat16_revision_of_the_same_weights_passes_the_gate(tiny, embed_a, runtime_factory):
    bf16 = runtime_factory("--model", f"emb={tiny['bert-embed']}", "--dtype", "bfloat16")
    served = card(bf16, "emb")["dtype"]
    result = compare(outputs(probe(embed_a, "emb")), outputs(probe(bf16, "emb")), 0.999)
    print(f"bert-embed {served} vs float32: {result.message}")
    assert result.passed, result.message
    assert result.order_kept and result.min_cosine >= 0.999
    if served == "bfloat16":  # a CPU where bf16 crashes serves float32 (engines/cpu_isa.py): same outputs then
        assert card(bf16, "emb")["fingerprint"] != card(embed_a, "emb")["fingerprint"]


def test_probe_shape_per_task(multi):
    n = len(PROBE.texts)
    per_query = len(PROBE.rerank[0].documents)
    emb = probe(multi, "bert-embed")
    assert (emb["task"], emb["revision"], emb["vector_space"]) == ("embed", "r1", "r1")
    vectors = np.asarray(emb["outputs"])
    assert vectors.shape == (n, 32)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)

    rerank = np.asarray(probe(multi, "bert-rerank")["outputs"])
    assert rerank.shape == (len(PROBE.rerank), per_query)
    # raw relevance scores, the same the /rerank route gives (raw_scores) for the first probe query
    ranked = httpx.post(f"{multi.url}/rerank", json={"model": "bert-rerank", "query": PROBE.rerank[0].query,
                                                       "texts": list(PROBE.rerank[0].documents),
                                                       "raw_scores": True}, timeout=60).json()
    by_index = {r["index"]: r["score"] for r in ranked}
    assert np.allclose([by_index[i] for i in range(per_query)], rerank[0], atol=1e-3)

    classify = probe(multi, "bert-classify")
    probs = np.asarray(classify["outputs"])
    assert classify["task"] == "classify" and probs.shape == (n, 3)
    assert np.allclose(probs.sum(axis=1), 1, atol=1e-4) and (probs >= 0).all()

    sparse = np.asarray(probe(multi, "splade")["outputs"])
    assert sparse.shape == (n, SPARSE_BUCKETS) and (sparse >= 0).all() and (sparse.sum(axis=1) > 0).all()

    colbert = np.asarray(probe(multi, "colbert")["outputs"])
    assert colbert.shape == (n, COLBERT_DIM)
    assert np.allclose(np.linalg.norm(colbert, axis=1), 1, atol=1e-4)

    fresh = probe(multi, "bert-classify", fresh=1)
    assert fresh["fresh"] is True and fresh["gate"]["passed"], fresh["gate"]
    assert fresh["fingerprint"] == classify["fingerprint"]


def test_revision_names_and_cards(multi):
    c = card(multi, "bert-embed")
    assert (c["revision"], c["vector_space"], c["probe_set"]) == ("r1", "r1", PROBE.version)
    own = httpx.post(f"{multi.url}/v1/embeddings", json={"model": "bert-embed@r1", "input": "hello"}, timeout=60)
    assert own.status_code == 200, own.text
    assert own.json()["model"] == "bert-embed"
    plain = httpx.post(f"{multi.url}/v1/embeddings", json={"model": "bert-embed", "input": "hello"}, timeout=60)
    assert plain.json()["data"][0]["embedding"] == own.json()["data"][0]["embedding"]
    other = httpx.post(f"{multi.url}/v1/embeddings", json={"model": "bert-embed@r2", "input": "hello"}, timeout=60)
    assert other.status_code == 404
    message = other.json()["error"]["message"]
    assert "bert-embed@r2" in message and "bert-embed@r1" in message
    assert httpx.post(f"{multi.url}/rerank", json={"model": "bert-rerank@r1", "query": "q", "texts": ["a", "b"]},
                      timeout=60).status_code == 200
    assert httpx.get(f"{multi.url}/v1/models/bert-embed@r1/probe", timeout=60).status_code == 200
    assert httpx.get(f"{multi.url}/v1/models/bert-embed@r3/probe", timeout=60).status_code == 404


PINNED_REQUESTS = [
    ("/v1/embeddings", {"model": "bert-embed", "input": ["a", "b"]}),
    ("/embed", {"model": "bert-embed", "inputs": "a"}),
    ("/v2/embed", {"model": "bert-embed", "texts": ["a"], "input_type": "search_query", "embedding_types": ["float"]}),
    ("/rerank", {"model": "bert-rerank", "query": "q", "texts": ["a", "b"]}),
    ("/v1/rerank", {"model": "bert-rerank", "query": "q", "documents": ["a", "b"]}),
    ("/classify", {"model": "bert-classify", "input": ["a"]}),
    ("/predict", {"model": "bert-classify", "inputs": "a"}),
    ("/embed_sparse", {"model": "splade", "inputs": "a"}),
    ("/embed_all", {"model": "colbert", "inputs": "a"}),
    ("/tokenize", {"model": "bert-embed", "inputs": "a"}),
]


def test_a_request_pinned_to_another_vector_space_is_refused_before_the_engine(multi):
    before = multi.metric("embedfleet_inputs_total")
    for path, body in PINNED_REQUESTS:
        r = httpx.post(multi.url + path, json=body, headers={HEADER: "r2"}, timeout=60)
        assert r.status_code == 409, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "vector_space_mismatch" == error["code"]
        assert "'r2'" in error["message"] and "'r1'" in error["message"]
        assert r.headers["x-embedfleet-vector-space"] == "r1"
    assert httpx.get(f"{multi.url}/v1/models/bert-embed/probe", params={"fresh": 1}, headers={HEADER: "r2"},
                     timeout=60).status_code == 409
    assert multi.metric("embedfleet_inputs_total") == before  # none of them reached the engine
    assert multi.metric("embedfleet_errors_total", code="409") >= len(PINNED_REQUESTS)
    # the server keeps serving; a request pinned to its own space, or not pinned, is answered
    for headers in ({HEADER: "r1"}, {}):
        for path, body in PINNED_REQUESTS:
            r = httpx.post(multi.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 200, (path, r.text)
            assert r.headers["x-embedfleet-revision"] == "r1"
            assert r.headers["x-embedfleet-vector-space"] == "r1"
    assert multi.metric("embedfleet_inputs_total") > before
    assert httpx.get(f"{multi.url}/ready", timeout=10).status_code == 200


def write_reference(path: Path, body: dict) -> Path:
    path.write_text(json.dumps(body))
    return path


def test_drift_against_another_models_reference_is_measured_and_counted(tiny, embed_a, runtime_factory, tmp_path):
    other = runtime_factory("--model", f"emb={tiny['dense']}", "--probe-interval", "0")
    foreign = write_reference(tmp_path / "foreign.json", probe(other, "emb"))
    drifting = runtime_factory("--model", f"emb={tiny['bert-embed']}", "--probe-reference", str(foreign),
                               "--probe-interval", "0.5")
    # the start-up outputs are the first check; the re-runs keep counting
    wait_for(lambda: drifting.metric("embedfleet_probe_checks_total", outcome="drift") >= 3, "three drift checks")
    cosine = drifting.metric("embedfleet_probe_cosine", model="emb")
    print(f"bert-embed against dense's reference: embedfleet_probe_cosine {cosine:.6f}")
    assert cosine < 0.999
    assert drifting.metric("embedfleet_probe_checks_total", outcome="ok") == 0
    assert "probe drift on emb" in drifting.log() and "probe min cosine" in drifting.log()
    # drift is reported, not fatal: the server keeps its own fingerprint and keeps serving
    assert card(drifting, "emb")["fingerprint"] == card(embed_a, "emb")["fingerprint"]
    assert httpx.post(f"{drifting.url}/embed", json={"inputs": "still serving"}, timeout=60).status_code == 200
    gate = probe(drifting, "emb", fresh=1)["gate"]
    assert gate["passed"] is False and gate["minCosine"] < 0.999


def test_no_drift_against_its_own_reference(tiny, embed_a, runtime_factory, tmp_path):
    own = write_reference(tmp_path / "own.json", probe(embed_a, "emb"))
    steady = runtime_factory("--model", f"emb={tiny['bert-embed']}", "--probe-reference", str(own),
                             "--probe-interval", "0.5", "--revision", "r4")
    wait_for(lambda: steady.metric("embedfleet_probe_checks_total", outcome="ok") >= 3, "three ok checks")
    assert steady.metric("embedfleet_probe_cosine", model="emb") >= 0.999
    assert steady.metric("embedfleet_probe_order_kept", model="emb") == 1
    assert steady.metric("embedfleet_probe_checks_total", outcome="drift") == 0
    assert steady.metric("embedfleet_probe_checks_total", outcome="error") == 0
    fp = card(steady, "emb")["fingerprint"]
    assert steady.metric("embedfleet_model_info", model="emb", revision="r4", vector_space="r4", fingerprint=fp) == 1
    # with a reference the start-up probe precedes readiness (a reference that does not fit refuses the start)
    assert log_position(steady, "probe probe-v1 of emb") < log_position(steady, "ready ")


def log_position(srv: RuntimeServer, words: str) -> int:
    """Where `words` first appear in the server's log (fails naming them when absent)."""
    found = srv.log().find(words)
    assert found >= 0, f"{words!r} not in the log"
    return found


def test_the_first_answer_does_not_wait_for_the_start_up_probe(tiny, runtime_factory):
    """Without --probe-reference the probe runs once the model serves, on the engine thread between the
    requests' batches; GET .../probe waits for it (503 probe_pending past a few seconds), and its series come
    when it is done."""
    srv = runtime_factory("--model", f"emb={tiny['bert-embed']}", "--revision", "r7")
    body = probe(srv, "emb")  # the harness waited for the start-up probe (tests/procs.py wait_probed)
    assert log_position(srv, "ready ") < log_position(srv, "probe probe-v1 of emb")
    assert body["fingerprint"].startswith("sha256:") and body["vector_space"] == "r7"
    assert card(srv, "emb")["fingerprint"] == body["fingerprint"]
    assert srv.metric("embedfleet_model_info", model="emb", revision="r7", vector_space="r7",
                      fingerprint=body["fingerprint"]) == 1
    assert srv.metric("embedfleet_probe_checks_total", outcome="error") == 0


def test_without_a_reference_the_start_up_probe_is_the_reference(tiny, runtime_factory):
    srv = runtime_factory("--model", f"emb={tiny['bert-embed']}", "--probe-interval", "0.5",
                          "--vector-space", "space-a", "--api-key", "k3y")
    key = {"authorization": "Bearer k3y"}
    wait_for(lambda: srv.metric("embedfleet_probe_checks_total", outcome="ok") >= 2, "two ok checks")
    assert srv.metric("embedfleet_probe_cosine", model="emb") >= 0.999
    # the start-up outputs are open like /metrics (the operator's gate reads pods with no key); a fresh
    # re-run is engine work and needs the key
    body = probe(srv, "emb")
    assert (body["vector_space"], body["revision"]) == ("space-a", None)
    url = f"{srv.url}/v1/models/emb/probe"
    assert httpx.get(url, params={"fresh": 1}, timeout=60).status_code == 401
    assert httpx.get(url, params={"fresh": 1}, headers=key, timeout=60).json()["gate"]["passed"] is True
    assert httpx.get(f"{srv.url}/v1/models", timeout=60).status_code == 401
    r = httpx.post(f"{srv.url}/embed", json={"inputs": "x"}, headers={**key, HEADER: "space-a"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-embedfleet-vector-space"] == "space-a"
    assert "x-embedfleet-revision" not in r.headers  # no revision was given


def refused(*flags: str) -> str:
    """Start a server that must refuse to start; its output."""
    srv = start_runtime(*flags, wait_ready=False)
    try:
        srv.proc.wait(timeout=180)
    finally:
        srv.stop()
    assert srv.proc.returncode != 0
    return srv.log()


def test_bad_flags_refuse_to_start(tmp_path, tiny, embed_a):
    assert "--revision" in refused("--revision", "x1")
    assert "--vector-space" in refused("--vector-space", "no spaces allowed")
    assert "--probe-interval" in refused("--probe-interval", "-1")
    assert "--probe-min-cosine" in refused("--probe-min-cosine", "1.5")
    missing = refused("--probe-reference", str(tmp_path / "missing.json"))
    assert "--probe-reference" in missing and "missing.json" in missing
    (tmp_path / "broken.json").write_text("{not json")
    assert "not JSON" in refused("--probe-reference", str(tmp_path / "broken.json"))
    body = probe(embed_a, "emb")
    old = write_reference(tmp_path / "old.json", {**body, "probe_set": "probe-v0"})
    assert "probe-v0" in refused("--model", f"emb={tiny['bert-embed']}", "--probe-reference", str(old))
    ragged = write_reference(tmp_path / "ragged.json", {**body, "outputs": [[1.0, 2.0], [1.0]]})
    assert "equally long" in refused("--model", f"emb={tiny['bert-embed']}", "--probe-reference", str(ragged))
    # the model's task is known only once it loads: a reranker's reference for an embedder stops it there
    rerank = write_reference(tmp_path / "rerank.json", {**body, "task": "rerank", "outputs": [[0.1] * 5] * 4})
    log = refused("--model", f"emb={tiny['bert-embed']}", "--probe-reference", str(rerank))
    assert "--probe-reference holds rerank outputs" in log
    # an embedder of another dimension cannot be this model's reference either
    narrow = write_reference(tmp_path / "narrow.json", {**body, "outputs": [row[:8] for row in body["outputs"]]})
    assert "not the same kind of model" in refused("--model", f"emb={tiny['bert-embed']}", "--probe-reference",
                                                    str(narrow))


def test_a_failing_check_counts_error_and_the_monitor_goes_on():
    """The check itself failing (the engine refused the probe) is counted, never raised: in-process, since a
    real engine cannot be made to fail on demand."""
    import asyncio

    from embedfleet.runtime.drift import DriftMonitor
    from embedfleet.runtime.metrics import RuntimeMetrics

    reference = ProbeOutputs.of("embed", np.eye(4))
    calls = []

    async def flaky() -> ProbeOutputs:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine failed the batch")
        return reference

    async def scenario() -> None:
        metrics = RuntimeMetrics()
        monitor = DriftMonitor("m", reference, flaky, 0.01, 0.999, metrics)
        monitor.start()
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        await monitor.stop()
        sample = metrics.registry.get_sample_value
        assert sample("embedfleet_probe_checks_total", {"model": "m", "outcome": "error"}) == 1
        assert sample("embedfleet_probe_checks_total", {"model": "m", "outcome": "ok"}) >= 1
        assert sample("embedfleet_probe_cosine", {"model": "m"}) == pytest.approx(1.0)

    asyncio.run(scenario())
