"""The gateway in front of a real runtime and a stand-in: routing by model, answers passed through
unchanged, clear 4xx for bad requests (and the gateway keeps serving), its own load report."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest

from tests.gateway.conftest import MODEL, start_gateway, start_stub
from tests.procs import ROOT, child_env

TEXTS = ["the gateway routes by model", "a second sentence, longer than the first one by a few words"]


@pytest.fixture(scope="module")
def stub():
    srv = start_stub("--model", "other", "--name", "stub")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gateway(server, stub):
    """In front of the shared runtime (MODEL) and the stand-in ("other")."""
    srv = start_gateway("--upstream", f"{MODEL}={server.url}", "--upstream", f"other={stub.url}",
                        "--payload-limit", "100000")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def single(server):
    """In front of the shared runtime only."""
    srv = start_gateway("--upstream", f"{MODEL}={server.url}")
    yield srv
    srv.stop()


def vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([row["embedding"] for row in response.json()["data"]])


def test_embeddings_through_the_gateway_equal_direct_ones(gateway, server):
    body = {"model": MODEL, "input": TEXTS}
    via = httpx.post(f"{gateway.url}/v1/embeddings", json=body, timeout=60)
    direct = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert via.json()["model"] == direct.json()["model"] == MODEL
    np.testing.assert_allclose(vectors(via), vectors(direct), atol=1e-5)
    # the replica's own headers come through
    assert "x-embedfleet-expected-wait" in via.headers and via.headers["server-timing"].startswith("total;dur=")


@pytest.mark.parametrize("head_first", [0.0, 0.05], ids=["head-with-body", "head-before-body"])
def test_each_answer_is_passed_on_once_however_it_arrives(gateway, stub, head_first):
    """A short 200 goes to the client from the lean client's callback when it arrives whole, and through
    the request's coroutine when its head comes first: either way exactly once, whole, on a kept-alive
    connection (a second copy would be read as the next answer)."""
    stub.control(head_first=head_first)
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(4):
                answer = client.post(f"{gateway.url}/v1/embeddings", json={"model": "other", "tag": f"t{i}"})
                assert answer.status_code == 200 and answer.json() == {"served_by": "stub", "tag": f"t{i}"}
                assert answer.headers["x-embedfleet-expected-wait"] == "0.0000"
    finally:
        stub.control(head_first=0.0)


def test_a_long_answer_is_streamed_through_unchanged(gateway, server):
    body = {"model": MODEL, "input": [f"short text {i}" for i in range(120)]}
    via = httpx.post(f"{gateway.url}/v1/embeddings", json=body, timeout=120)
    direct = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=120)
    assert int(via.headers["content-length"]) > 256 * 1024  # past the one-write size: streamed
    np.testing.assert_allclose(vectors(via), vectors(direct), atol=1e-5)


def test_tei_body_without_a_model_goes_to_the_only_deployment(single, server):
    via = httpx.post(f"{single.url}/embed", json={"inputs": TEXTS}, timeout=60)
    direct = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS}, timeout=60)
    assert via.status_code == 200, via.text
    np.testing.assert_allclose(np.array(via.json()), np.array(direct.json()), atol=1e-5)


def test_routes_by_model(gateway, stub):
    before = len(stub.received())
    other = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "other", "input": "x", "tag": "o"}, timeout=60)
    mine = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=60)
    assert other.status_code == 200 and other.json() == {"served_by": "stub", "tag": "o"}
    assert mine.status_code == 200 and mine.json()["model"] == MODEL
    assert [e["tag"] for e in stub.received()[before:]] == ["o"]


def test_passes_the_headers_that_matter_and_the_time_left(gateway, stub):
    headers = {"authorization": "Bearer sk-test", "x-priority": "bulk", "x-request-id": "req-1",
               "x-request-timeout": "30", "cookie": "not-for-upstream"}
    r = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "other", "input": "x", "tag": "h"},
                   headers=headers, timeout=60)
    assert r.status_code == 200
    seen = next(e for e in reversed(stub.received()) if e["tag"] == "h")["headers"]
    assert seen["authorization"] == "Bearer sk-test" and seen["x-priority"] == "bulk"
    assert seen["x-request-id"] == "req-1" and seen["content-type"] == "application/json"
    assert 0 < float(seen["x-request-timeout"]) <= 30
    assert "cookie" not in seen


def test_unknown_model_is_404_naming_the_known_ones(gateway):
    r = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "gpt-9", "input": "x"}, timeout=10)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "not_found_error"
    assert "gpt-9" in error["message"] and MODEL in error["message"] and "other" in error["message"]


def test_no_model_with_several_deployments_is_400(gateway):
    r = httpx.post(f"{gateway.url}/embed", json={"inputs": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"
    assert MODEL in r.json()["error"]["message"]


@pytest.mark.parametrize(("send", "status", "code"), [
    ({"content": b'{"model": "all-MiniLM', "headers": {"content-type": "application/json"}}, 400, "invalid_json"),
    ({"content": b"", "headers": {"content-type": "application/json"}}, 400, "invalid_json"),
    ({"json": {"model": 7, "input": "x"}}, 400, "invalid_request"),
    ({"json": {"model": MODEL, "input": "x" * 200_000}}, 413, "payload_too_large"),
    ({"content": iter([b'{"input": "', b"x" * 150_000, b'"}']), "headers": {"content-type": "application/json"}},
     413, "payload_too_large"),  # chunked: no content-length to refuse it by
    ({"json": {"model": MODEL, "input": "x"}, "headers": {"x-request-timeout": "soon"}}, 422, "invalid_timeout"),
], ids=["malformed-json", "empty-body", "model-not-a-string", "oversized", "oversized-chunked", "bad-timeout"])
def test_bad_requests_get_a_clear_4xx_and_the_gateway_keeps_serving(gateway, send, status, code):
    r = httpx.post(f"{gateway.url}/v1/embeddings", timeout=30, **send)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]
    ok = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": "still here"}, timeout=60)
    assert ok.status_code == 200


def test_runtime_errors_come_back_unchanged(gateway, server):
    body = {"model": MODEL, "query": "q", "texts": ["a"]}  # reranking an embedding model
    via = httpx.post(f"{gateway.url}/rerank", json=body, timeout=30)
    direct = httpx.post(f"{server.url}/rerank", json=body, timeout=30)
    assert via.status_code == direct.status_code == 400
    assert via.json() == direct.json()


def test_models_lists_every_deployment(gateway):
    r = httpx.get(f"{gateway.url}/v1/models", timeout=30)
    assert r.status_code == 200
    cards = {card["id"]: card for card in r.json()["data"]}
    assert set(cards) == {MODEL, "other"}
    assert cards[MODEL]["dimensions"] == 384  # the runtime's own card, unchanged


def test_load_report_and_metrics(gateway):
    before = gateway.count("embedfleet_gateway_requests_total", deployment=MODEL, code="200")
    assert httpx.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=60).status_code \
        == 200
    load = gateway.load()
    assert set(load) == {MODEL, "other"}
    assert load[MODEL]["ready_replicas"] == load[MODEL]["replicas"] == 1
    assert load[MODEL]["in_flight"] == load[MODEL]["held"] == 0
    assert 0 <= load[MODEL]["last_request_age_s"] < 60
    assert gateway.count("embedfleet_gateway_requests_total", deployment=MODEL, code="200") == before + 1
    assert gateway.count("embedfleet_gateway_upstream_seconds_count", deployment=MODEL) >= 1
    assert gateway.count("embedfleet_gateway_requests_in_flight", deployment=MODEL) == 0
    assert gateway.count("embedfleet_gateway_held_requests", deployment="other") == 0
    assert gateway.count("embedfleet_gateway_requests_total", deployment="-", code="404") >= 0
    assert httpx.get(f"{gateway.url}/health", timeout=10).json() == {"status": "ok"}


def test_the_gateway_imports_neither_torch_nor_the_runtime():
    code = ("import sys, embedfleet.gateway.cli, embedfleet.gateway.proxy\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('embedfleet.runtime.', 'fastapi', "
            "'transformers'))]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), cwd=ROOT)
