"""Every kind of bad input gets a clear 4xx in one JSON shape, and the server keeps serving."""

from __future__ import annotations

import pytest

BAD = [
    # (description, kwargs for httpx.post, expected status, words the message must contain)
    ("malformed JSON", {"content": b'{"input": ', "headers": {"content-type": "application/json"}}, 400, "JSON"),
    ("not an object", {"content": b"[1, 2]"}, 422, "object"),
    ("missing input", {"json": {"model": "all-MiniLM-L6-v2"}}, 422, "input"),
    ("wrong type", {"json": {"input": 5}}, 422, "input"),
    ("wrong nested type", {"json": {"input": [["a", 1]]}}, 422, "input"),
    ("empty list", {"json": {"input": []}}, 422, "empty"),
    ("empty string", {"json": {"input": ["ok", ""]}}, 422, "input 1"),
    ("whitespace string", {"json": {"input": "   "}}, 422, "input 0"),
    ("unknown model", {"json": {"input": "x", "model": "gpt-9"}}, 404, "gpt-9"),
    ("bad encoding", {"json": {"input": "x", "encoding_format": "int4"}}, 422, "encoding_format"),
    ("too many dimensions", {"json": {"input": "x", "dimensions": 4096}}, 422, "384"),
    ("negative token", {"json": {"input": [[101, -5, 102]]}}, 422, "input"),
    ("token out of vocab", {"json": {"input": [[101, 99999999, 102]]}}, 422, "vocabulary"),
    ("mixed kinds", {"json": {"input": ["text", [101, 102]]}}, 422, "input"),
]


@pytest.mark.parametrize(("what", "kwargs", "status", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_then_good_request(server, what, kwargs, status, words):
    with server.client() as c:
        resp = c.post("/v1/embeddings", **kwargs)
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "code"}
        assert words.lower() in error["message"].lower(), error["message"]
        ok = c.post("/v1/embeddings", json={"input": "the server still serves"})
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


def test_limits_each_have_their_own_error(runtime_factory):
    srv = runtime_factory("--max-client-batch-size", "4", "--payload-limit", "2000", "--max-input-tokens", "16",
                          "--no-auto-truncate")
    with srv.client() as c:
        too_many = c.post("/v1/embeddings", json={"input": ["a"] * 5})
        assert too_many.status_code == 413 and "limit of 4" in too_many.json()["error"]["message"]
        too_big = c.post("/v1/embeddings", json={"input": ["a" * 3000]})
        assert too_big.status_code == 413 and "payload limit of 2000" in too_big.json()["error"]["message"]
        too_long = c.post("/v1/embeddings", json={"input": ["one two three four five six seven eight nine ten "
                                                            "eleven twelve thirteen fourteen fifteen sixteen"]})
        assert too_long.status_code == 413
        assert "input 0" in too_long.json()["error"]["message"] and "16" in too_long.json()["error"]["message"]
        allowed = c.post("/v1/embeddings", json={"input": ["one two three four five six seven eight nine ten "
                                                           "eleven twelve thirteen fourteen fifteen"],
                                                 "truncate": True})
        assert allowed.status_code == 200 and allowed.json()["usage"]["prompt_tokens"] == 16
        assert c.post("/v1/embeddings", json={"input": ["a"] * 4}).status_code == 200
    assert srv.metric("embedfleet_errors_total") >= 3
    assert srv.metric("embedfleet_truncated_inputs_total") == 1


def test_queue_full_is_429_with_retry_after(runtime_factory):
    """The concurrency cap refuses with 429 and Retry-After while the request it holds is answered in full.

    The held request is bulk work on a shared CPU: its lateness bound (--max-queue-seconds-bulk) is set far
    above any run's time, so what is tested is the cap alone, not how fast a loaded machine computes."""
    import threading
    import time

    import httpx

    srv = runtime_factory("--max-concurrent-requests", "1", "--max-batch-requests", "8",
                          "--max-queue-seconds-bulk", "3600")
    big = {"input": [f"passage {i} " + "text " * 200 for i in range(64)]}
    results = {}

    def send_big():
        results["big"] = httpx.post(f"{srv.url}/v1/embeddings", json=big, timeout=600)

    t = threading.Thread(target=send_big)
    t.start()
    deadline = time.monotonic() + 60
    while srv.metric("embedfleet_requests_in_flight") < 1 and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.005)
    assert t.is_alive(), "the held request finished before it could be observed in flight"
    refused = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "hi"}, timeout=60)
    t.join()
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert "capacity" in refused.json()["error"]["message"]
    assert results["big"].status_code == 200, results["big"].text
    assert len(results["big"].json()["data"]) == 64
    assert httpx.post(f"{srv.url}/v1/embeddings", json={"input": "hi"}, timeout=60).status_code == 200


def test_api_key(runtime_factory):
    import httpx

    srv = runtime_factory("--api-key", "s3cret-key")
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert httpx.get(f"{srv.url}/ready").status_code == 200
    assert httpx.get(f"{srv.url}/metrics").status_code == 200
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-key"}):
        resp = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"}, headers=headers)
        assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    good = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"},
                      headers={"authorization": "Bearer s3cret-key"})
    assert good.status_code == 200
    assert "s3cret-key" not in srv.log()
