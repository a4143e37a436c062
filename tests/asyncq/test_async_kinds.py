"""Async rerank and classify jobs: the same checks as their sync routes, and exactly their result."""

from __future__ import annotations

import pytest

from tests.asyncq.procs import start_redis
from tests.asyncq.test_api import wait_job
from tests.procs import start_runtime
from tests.tiny_models import build_all


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tiny = build_all(tmp_path_factory.mktemp("tiny"))
    redis_server = start_redis(appendonly=False)
    srv = start_runtime("--redis-url", redis_server.url, "--model", f"rr={tiny['bert-rerank']}",
                        "--model", f"cls={tiny['bert-classify']}", "--model", f"emb={tiny['bert-embed']}")
    yield srv
    srv.stop()
    redis_server.stop()


def test_async_rerank_equals_sync(stack) -> None:
    body = {"model": "rr", "query": "which text is about padding", "return_text": True,
            "texts": ["padding must never leak", "a", "cats purr", "the quick brown fox"]}
    with stack.client() as c:
        accepted = c.post("/async/rerank", json=body)
        assert accepted.status_code == 202, accepted.text
        doc = wait_job(c, accepted.json()["id"])
        sync = c.post("/rerank", json=body).json()
    assert doc["status"] == "succeeded" and doc["kind"] == "rerank"
    assert [r["index"] for r in doc["result"]] == [r["index"] for r in sync]
    assert [r["score"] for r in doc["result"]] == pytest.approx([r["score"] for r in sync], abs=1e-6)


def test_async_classify_equals_sync(stack) -> None:
    body = {"model": "cls", "input": ["good", "bad", "fine"], "top_k": 2}
    with stack.client() as c:
        accepted = c.post("/async/classify", json=body)
        assert accepted.status_code == 202, accepted.text
        doc = wait_job(c, accepted.json()["id"])
        sync = c.post("/classify", json=body).json()
    assert doc["status"] == "succeeded"
    assert [d["label"] for d in doc["result"]["data"]] == [d["label"] for d in sync["data"]]
    assert all(len(d["labels"]) == 2 for d in doc["result"]["data"])


@pytest.mark.parametrize(("route", "body", "status"), [
    ("/async/rerank", {"model": "emb", "query": "q", "texts": ["d"]}, 400),  # an embedder is no reranker
    ("/async/rerank", {"model": "rr", "query": "q", "texts": []}, 422),
    ("/async/classify", {"model": "rr", "input": ["x"]}, 400),
    ("/async/classify", {"model": "cls", "input": ["", "x"]}, 422),
    ("/async/classify", {"model": "missing", "input": ["x"]}, 404),
])
def test_refused_at_submission_like_the_sync_route(stack, route, body, status) -> None:
    with stack.client() as c:
        refused = c.post(route, json=body)
        sync = c.post(route.replace("/async", ""), json=body)
    assert refused.status_code == sync.status_code == status
    assert refused.json()["error"]["code"] == sync.json()["error"]["code"]
