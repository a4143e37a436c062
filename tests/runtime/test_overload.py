"""Under overload a real `embedfleet serve` answers quickly with 429 (or 504) instead of late with 200.

Issue 14: 256 clients got zero 429s, client time-outs at 60 s and a p99 of 59 s, because admission
counted requests and tokens but not how fast the engine drains them. These tests storm a real server
process (the embedded all-MiniLM-L6-v2 on this machine's CPU, which a few hundred clients overload
without any slowing knob) and check what each client sees.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import time

import httpx
import orjson

from tests.procs import RuntimeServer

PASSAGE = " ".join(f"word{i}" for i in range(60))  # ~120 tokens: each costs the engine real work
SENTENCE = " ".join(f"word{i}" for i in range(8))  # ~20 tokens


Outcome = tuple[str, int | str, float, httpx.Response | None]  # kind, status or exception name, seconds, response


async def _storm(srv: RuntimeServer, clients: int, seconds: float) -> list[Outcome]:
    """Closed-loop clients (one request at a time each) for `seconds`: 80% lone queries, 20% bulk batches
    of 8 sentences; a 429 is honoured as the OpenAI SDK does (Retry-After, here capped at 1 s)."""
    out: list[Outcome] = []
    until = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)

    async def one(i: int, http: httpx.AsyncClient) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            kind = "bulk" if (i + n) % 5 == 0 else "query"
            inputs = [f"{SENTENCE} {i} {n} {k}" for k in range(8)] if kind == "bulk" else f"{SENTENCE} {i} {n}"
            started = time.monotonic()
            try:
                resp = await http.post("/v1/embeddings", json={"input": inputs})
            except httpx.HTTPError as exc:  # a reset, a refused connection or a hang: all failures here
                out.append((kind, type(exc).__name__, time.monotonic() - started, None))
                continue
            out.append((kind, resp.status_code, time.monotonic() - started, resp))
            if resp.status_code == 429:
                await asyncio.sleep(min(1.0, float(resp.headers["retry-after"])))

    async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(one(i, http) for i in range(clients)))
    return out


def test_storm_is_answered_within_the_bound_or_refused(runtime_factory):
    srv = runtime_factory("--max-queue-seconds", "1", "--max-queue-seconds-bulk", "3")
    results = asyncio.run(_storm(srv, clients=200, seconds=8))

    statuses = {status for _, status, _, _ in results}
    assert statuses <= {200, 429, 504}, f"only answers, never a reset or a hang: {statuses}"
    for _, status, _, resp in results:
        body = orjson.loads(resp.content)
        if status == 200:
            assert body["data"]
        else:
            assert set(body["error"]) == {"message", "type", "code"}
        if status == 429:
            assert int(resp.headers["retry-after"]) >= 1
            assert "overloaded" in body["error"]["message"] or "queue holds" in body["error"]["message"]
    refused = sum(status == 429 for _, status, _, _ in results)
    assert refused >= 1, "200 clients must overload two CPU cores"
    assert refused == srv.metric("embedfleet_requests_shed_total"), "every 429 counted by its reason"

    # The promise: an accepted request is answered within its bound plus about one batch (bulk work also
    # waits for the queries that go first). Measured at the client, on two cores shared with the 200 clients
    # themselves and a CI run, hence the wide margin: it separates "bounded" from the 59 s p99 and
    # 60 s time-outs, it is not a speed figure (bench/storm.py reports the ratio).
    batches = srv.metric("embedfleet_batch_size_count")
    batch_s = srv.metric("embedfleet_engine_busy_seconds_total") / batches
    for kind, bound in (("query", 1.0), ("bulk", 3.0 + 1.0)):  # bulk also waits for queries that jump ahead
        latencies = sorted(t for k, status, t, _ in results if k == kind and status == 200)
        assert latencies, f"some {kind} requests are accepted"
        p99 = latencies[int(0.99 * (len(latencies) - 1))]
        assert p99 <= 3 * (bound + batch_s) + 10, (kind, p99, batch_s)

    # and afterwards the server serves normally, and is ready again
    deadline = time.monotonic() + 60
    while httpx.get(f"{srv.url}/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "ready again once the queue drains"
        time.sleep(0.2)
    ok = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "after the storm"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384


def _queue_a_long_bulk_request(srv: RuntimeServer) -> socket.socket:
    """A bulk request of many seconds of work, queued; its client stays until the caller closes the
    socket (then it has left, and its work is dropped), however slowly the caller's own requests go."""
    body = orjson.dumps({"input": [f"{PASSAGE} {PASSAGE} {i}" for i in range(256)]})
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while srv.metric("embedfleet_queue_tokens") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return sock


def test_a_deadline_that_cannot_be_met_is_504_at_once(runtime_factory):
    srv = runtime_factory()
    big = _queue_a_long_bulk_request(srv)
    small_batch = [f"{PASSAGE} {i}" for i in range(8)]  # over --urgent-max-inputs: waits behind the big one
    with srv.client() as c:
        by_header = c.post("/v1/embeddings", json={"input": small_batch}, headers={"x-request-timeout": "0.5"})
        by_body = c.post("/embed", json={"inputs": small_batch, "timeout": 0.5})
        marked_bulk = c.post("/v1/embeddings", json={"input": "one query"},
                             headers={"x-priority": "bulk", "x-request-timeout": "0.5"})
        bad = c.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-timeout": "soon"})
        negative = c.post("/v1/embeddings", json={"input": "x", "timeout": -1})
        query = c.post("/v1/embeddings", json={"input": "a query jumps the bulk work"},
                       headers={"x-request-timeout": "30"})
    big.close()
    for resp in (by_header, by_body, marked_bulk):
        assert resp.status_code == 504, resp.text
        assert "deadline cannot be met" in resp.json()["error"]["message"]
        assert resp.json()["error"]["code"] == "deadline_exceeded"
    # refused at admission, not after waiting: counted as shed, never as expired while queued
    assert srv.metric("embedfleet_requests_shed_total", reason="deadline") == 3
    assert srv.metric("embedfleet_deadline_expired_total") == 0
    assert bad.status_code == 422 and "X-Request-Timeout" in bad.json()["error"]["message"]
    assert negative.status_code == 422 and "timeout" in negative.json()["error"]["message"]
    assert query.status_code == 200, "a small request with a generous deadline still goes ahead"


#: One bulk request of 128 x 128 token ids (16,384 tokens): a batch of seconds on a CPU, still running a
#: few requests after it started.
HUGE = [[101] + [2000 + (i * 37 + k) % 5000 for k in range(126)] + [102] for i in range(128)]
HUGE_TOKENS = sum(map(len, HUGE))
POLLS = 10_000  # at 1 ms apart: only so that a broken hand-over fails instead of hanging


async def _poll_load(http: httpx.AsyncClient, ready, waiting: asyncio.Task, what: str) -> dict:
    """GET /load until `ready(load, model)`; fails if `waiting` was answered first."""
    for _ in range(POLLS):
        load = (await http.get("/load")).json()
        (model,) = load["models"].values()
        if ready(load, model):
            return model
        assert not waiting.done(), (f"answered before {what}", waiting.result().text[:300])
        await asyncio.sleep(0.001)
    raise AssertionError(f"never saw {what}: {load}")


def test_queued_work_past_its_deadline_is_dropped_unrun(runtime_factory):
    """A bulk request admitted in time, then held past its deadline behind a long batch on an engine that
    stalls, is answered 504, and none of its inputs ever reaches the engine.

    It is admitted while one long batch is on the engine; its deadline is the server's own expected wait
    (GET /load) with a margin, so admission does not refuse it up front. Then the server process is stopped
    (SIGSTOP, as a host that freezes stops it) for longer than that deadline: the clock runs on, so when it
    resumes the deadline has passed while the engine is still busy with the long batch. That the long batch
    was on the engine through the stop is checked, not assumed: its wall time spans the stop
    (embedfleet_batch_seconds_max). No step depends on how fast this machine is."""
    srv = runtime_factory("--max-queue-seconds-bulk", "3600", "--bulk-batch-seconds", "0",
                          "--max-batch-requests", str(len(HUGE)), "--max-batch-tokens", str(HUGE_TOKENS))

    async def scenario() -> tuple[httpx.Response, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as http:
            long = asyncio.create_task(http.post("/v1/embeddings", json={"input": HUGE},
                                                 headers={"x-priority": "bulk"}))
            on_engine = await _poll_load(http, lambda load, m: load["in_flight"] == 1 and m["queue_tokens"] == 0,
                                         long, "the long batch on the engine")
            allowed = math.ceil(on_engine["expected_wait_s"]) + 1
            bulk = asyncio.create_task(http.post(
                "/v1/embeddings", json={"input": [f"bulk {k}" for k in range(7)]},
                headers={"x-priority": "bulk", "x-request-timeout": f"{allowed:g}"}))
            await _poll_load(http, lambda _load, m: m["queue_tokens"] > 0, bulk, "the bulk request queued")
            os.kill(srv.proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                await asyncio.sleep(allowed + 1.0)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            stop = time.monotonic() - stopped
            return await bulk, await long, stop

    bulk, long, stop = asyncio.run(scenario())
    assert long.status_code == 200, long.text[:300]
    assert srv.metric("embedfleet_batch_seconds_max") >= stop, "the long batch ended before the stop: lengthen it"
    assert bulk.status_code == 504, bulk.text
    assert "passed while the request waited" in bulk.json()["error"]["message"]
    assert srv.metric("embedfleet_deadline_expired_total") == 1
    # every input the engine ran was the long batch's: the bulk request's 7 never ran
    assert srv.metric("embedfleet_inputs_total") == len(HUGE)


def test_over_long_input_list_is_refused_before_validation(server):
    """20,000 `{}` items (60 KB) cost 0.29 s of event-loop CPU in full validation; the precheck
    refuses them by count, and a malformed item by type, with a message naming the limit or the item."""
    with server.client() as c:
        too_many = c.post("/v1/embeddings", content=b'{"input": [' + b",".join([b"{}"] * 20_000) + b"]}")
        assert too_many.status_code == 413
        assert "20000 inputs is over the limit of 2048" in too_many.json()["error"]["message"]
        rerank_many = c.post("/v1/rerank", json={"query": "q", "documents": ["d"] * 3000})
        assert rerank_many.status_code == 413
        not_text = c.post("/v1/embeddings", json={"input": ["fine", {}]})
        assert not_text.status_code == 422 and "input.1" in not_text.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"input": ["fine"] * 3}).status_code == 200
