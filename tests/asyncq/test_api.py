"""The async API over HTTP on a real server with a real Redis: submit, poll, refuse, cache, priority."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from embedfleet.runtime.asyncq.store import JobStore, connect
from tests.asyncq.procs import KEYS, start_redis, wait_for
from tests.procs import RuntimeServer, start_runtime


@pytest.fixture(scope="module")
def stack():
    """One Redis and one runtime replica (API + in-process worker + cache) shared by this module."""
    redis_server = start_redis(appendonly=False)
    srv = start_runtime("--redis-url", redis_server.url, "--cache-enabled", "--webhook-secret", "s3cret",
                        "--max-input-tokens", "64")
    yield srv, redis_server
    srv.stop()
    redis_server.stop()


def wait_job(c: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    doc: dict = {}

    def finished() -> bool:
        nonlocal doc
        doc = c.get(f"/async/jobs/{job_id}").json()
        return doc["status"] in ("succeeded", "failed")

    wait_for(finished, timeout, f"job {job_id}")
    return doc


def test_submit_then_poll_gives_the_sync_result(stack) -> None:
    srv, _ = stack
    with srv.client() as c:
        texts = ["the async path", "returns what the sync path returns"]
        accepted = c.post("/async/v1/embeddings", json={"input": texts, "dimensions": 128})
        assert accepted.status_code == 202
        job = accepted.json()
        assert job["status"] == "queued" and accepted.headers["location"] == f"/async/jobs/{job['id']}"
        doc = wait_job(c, job["id"])
        sync = c.post("/v1/embeddings", json={"input": texts, "dimensions": 128}).json()
    assert doc["status"] == "succeeded" and doc["attempts"] == 1 and doc["finished_at"] >= doc["created_at"]
    assert [d["index"] for d in doc["result"]["data"]] == [0, 1]
    assert doc["result"]["usage"] == sync["usage"] and doc["result"]["model"] == sync["model"]
    for got, want in zip(doc["result"]["data"], sync["data"], strict=True):
        assert len(got["embedding"]) == 128
        np.testing.assert_allclose(got["embedding"], want["embedding"], atol=1e-5)


@pytest.mark.parametrize("body", [
    {"input": []}, {"input": ["ok", "  "]}, {"input": "x", "dimensions": 10_000}, {"input": "x", "model": "nope"},
    {"input": [1, 2, 99_999_999]}, {"input": "word " * 200, "truncate": False}, {"input": 5},
    {"input": "x", "encoding_format": "hex"},
])
def test_bad_input_is_refused_exactly_like_the_sync_route(stack, body: dict) -> None:
    srv, redis_server = stack
    with srv.client() as c:
        sync = c.post("/v1/embeddings", json=body)
        before = redis_server.client().zcard(KEYS.unfinished)
        refused = c.post("/async/v1/embeddings", json=body)
    assert 400 <= sync.status_code < 500
    assert refused.status_code == sync.status_code
    assert refused.json()["error"]["code"] == sync.json()["error"]["code"]
    assert redis_server.client().zcard(KEYS.unfinished) == before  # nothing was stored


@pytest.mark.parametrize("url,fragment", [
    ("ftp://example.com/hook", "http or https"),
    ("http://127.0.0.1:9/hook", "--webhook-allow-private"),
    ("http://10.0.0.1/hook", "--webhook-allow-private"),
    ("not a url", "http or https"),
])
def test_webhook_url_is_checked_at_submission(stack, url: str, fragment: str) -> None:
    srv, _ = stack
    with srv.client() as c:
        refused = c.post("/async/v1/embeddings", json={"input": "x", "webhook_url": url})
    assert refused.status_code == 422
    assert refused.json()["error"]["code"] == "invalid_webhook_url" and fragment in refused.json()["error"]["message"]


def test_unknown_job_is_404(stack) -> None:
    srv, _ = stack
    with srv.client() as c:
        assert c.get("/async/jobs/0123456789abcdef").status_code == 404
        assert c.get("/async/jobs/..%2F..%2Fetc").status_code == 404


def test_job_that_fails_in_the_worker_ends_failed_with_the_reason(stack) -> None:
    """A record the worker cannot run (here: written by an older release, empty input) fails, never loops."""
    srv, redis_server = stack

    async def submit() -> str | None:
        store = JobStore(connect(redis_server.url), KEYS)
        try:
            return await store.submit("embeddings", b'{"input": []}', None, 1000)
        finally:
            await store.close()

    job_id = asyncio.run(submit())
    assert job_id is not None
    with srv.client() as c:
        doc = wait_job(c, job_id)
    assert doc["status"] == "failed" and "empty" in doc["error"]["message"] and "result" not in doc


def test_second_identical_request_is_a_cache_hit_with_the_same_vector(stack) -> None:
    srv, _ = stack
    body = {"input": ["cache me if you can", "and me"], "encoding_format": "float"}
    with srv.client() as c:
        hits0 = srv.metric("embedfleet_cache_hits_total")
        inputs0 = srv.metric("embedfleet_inputs_total")
        first = c.post("/v1/embeddings", json=body).json()
        assert srv.metric("embedfleet_cache_hits_total") == hits0
        second = c.post("/v1/embeddings", json=body).json()
        assert srv.metric("embedfleet_cache_hits_total") == hits0 + 2
        assert srv.metric("embedfleet_inputs_total") == inputs0 + 2  # the engine saw them once
        async_doc = wait_job(c, c.post("/async/v1/embeddings", json=body).json()["id"])
    assert srv.metric("embedfleet_cache_hits_total") == hits0 + 4
    assert 0 < srv.metric("embedfleet_cache_hit_ratio") <= 1
    for a, b, d in zip(first["data"], second["data"], async_doc["result"]["data"], strict=True):
        assert a["embedding"] == b["embedding"] == d["embedding"]


def test_sync_query_is_not_stuck_behind_a_backfill(stack) -> None:
    """While hundreds of async inputs are queued, a sync single query is answered before they finish."""
    srv, _ = stack
    with srv.client() as c:
        ids = [c.post("/async/v1/embeddings", json={"input": [f"backfill row {j} of job {i}" for j in range(64)]})
               .json()["id"] for i in range(40)]
        wait_for(lambda: srv.metric("embedfleet_queue_tokens") > 0, 60, "the backfill to reach the batch manager")
        answer = c.post("/v1/embeddings", json={"input": "an urgent query"})
        assert answer.status_code == 200
        states = [c.get(f"/async/jobs/{i}").json()["status"] for i in ids]
        assert states.count("succeeded") < len(ids)  # answered while the backfill was still running
        for job_id in ids:
            assert wait_job(c, job_id)["status"] == "succeeded"
    wait_for(lambda: srv.metric("embedfleet_async_queue_depth") == 0, 10, "the depth gauge to reach 0")


def test_openapi_lists_the_async_routes(stack) -> None:
    srv, _ = stack
    with srv.client() as c:
        spec = c.get("/openapi.json").json()
    assert "/async/v1/embeddings" in spec["paths"] and "/async/jobs/{job_id}" in spec["paths"]
    assert "webhook_url" in spec["components"]["schemas"]["AsyncEmbeddingRequest"]["properties"]


def test_server_without_redis_has_no_async_routes(server: RuntimeServer) -> None:
    with server.client() as c:
        assert c.post("/async/v1/embeddings", json={"input": "x"}).status_code == 404
