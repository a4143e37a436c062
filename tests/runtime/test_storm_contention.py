"""Admission keeps its promise when another process takes a core away from the engine.

A real `embedfleet serve` on both cores, a CPU hog pinned (sched_setaffinity) to one of them from
after start-up for the whole storm, and a storm of closed-loop clients in this process: lone queries
and bulk requests of 8 and 32 inputs. The server keeps both cores, as a pod beside a busy neighbour
does, so the engine's threads share the hog's core and run at the pace of the slower one: its speed
measured at start-up (the warm-up batch, before the hog) is out of date from the first request, and
it stays erratic (from a fraction of a second to seconds per batch) throughout.

The promise, and only what the server measures: an accepted request waits (`server-timing` tokenize +
queue + inference: from the request being whole to the end of its last batch) at most its class's bound
plus one batch, and every other one is refused with 429 and Retry-After; no 5xx, no time-out. "One batch"
is the server's own figure, `embedfleet_batch_seconds_max` (the longest wall time of one engine batch since
it started), so a loaded machine slows the batches and the promise with them, but cannot fail a working
admission, and a broken admission (one that admits past its bound) fails whatever the machine's load. The
whole answer (`total`: encoding it on a core shared with the hog included) comes within one more batch.
What the clients saw, on two cores shared with the server and the hog, holds their own event loop's
delays, which the server promises nothing about: it is printed, not judged (bench/storm.py measures it).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

import httpx
import pytest

from tests.procs import RuntimeServer, spawn, stop_process

QUERY_BOUND_S = 2.0
BULK_BOUND_S = 6.0
CLIENTS = 96
STORM_S = 15.0
WORDS = [f"word{i}" for i in range(400)]

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs sched_setaffinity and two cores")


def server_timing(value: str | None) -> dict[str, float]:
    """`total;dur=12.5, inference;dur=3` -> {"total": 0.0125, "inference": 0.003} (seconds)."""
    parts: dict[str, float] = {}
    for metric in (value or "").split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, dur = param.strip().partition("=")
            if key == "dur":
                parts[name.strip()] = float(dur) / 1000
    return parts


def longest_batch(srv: RuntimeServer) -> float:
    """`embedfleet_batch_seconds_max` from the server's /metrics (the largest over its models)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{srv.url}/metrics", timeout=30).text.splitlines()
              if line.startswith("embedfleet_batch_seconds_max{")]
    return max(values, default=0.0)


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 8, 12, 30, 60))))


Outcome = tuple[str, int | str, float, dict[str, float]]  # kind, status or error, client seconds, server-timing


async def storm(srv: RuntimeServer) -> list[Outcome]:
    """Closed-loop clients: 70% lone queries, 20% bulk requests of 8 inputs, 10% of 32; a 429 is honoured
    (Retry-After, capped at 1 s so the storm stays a storm)."""
    out: list[Outcome] = []
    until = time.monotonic() + STORM_S
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)

    async def client(i: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(i)
        while time.monotonic() < until:
            r = rng.random()
            kind, n = ("single", 1) if r < 0.7 else ("bulk", 8) if r < 0.9 else ("bulk", 32)
            started = time.monotonic()
            try:
                resp = await http.post("/v1/embeddings", json={"input": [text(rng) for _ in range(n)]})
            except httpx.HTTPError as exc:  # a time-out, a reset: all failures here
                out.append((kind, type(exc).__name__, time.monotonic() - started, {}))
                continue
            timing = server_timing(resp.headers.get("server-timing"))
            out.append((kind, resp.status_code, time.monotonic() - started, timing))
            if resp.status_code == 429:
                assert int(resp.headers["retry-after"]) >= 1
                await asyncio.sleep(min(1.0, float(resp.headers["retry-after"])))

    async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(CLIENTS)))
    return out


def test_accepted_work_keeps_its_bound_with_a_core_taken(runtime_factory):
    srv = runtime_factory("--max-queue-seconds", str(QUERY_BOUND_S), "--max-queue-seconds-bulk", str(BULK_BOUND_S))
    hog = spawn([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {max(os.sched_getaffinity(0))})
        time.sleep(0.5)  # the hog has its core before the first request
        results = asyncio.run(storm(srv))
    finally:
        stop_process(hog)

    statuses = {status for _, status, _, _ in results}
    assert statuses <= {200, 429}, f"answers or refusals only: no 5xx, no time-out, no reset: {statuses}"
    refused = sum(status == 429 for _, status, _, _ in results)
    assert refused >= 1, "a core taken away under a storm must overload the engine"
    accepted = [(kind, client_s, timing) for kind, status, client_s, timing in results if status == 200]
    batch_s = longest_batch(srv)
    assert batch_s > 0, "the server reports its longest batch"
    report = {kind: sorted(round(timing["total"], 2) for k, _, timing in accepted if k == kind)[-5:]
              for kind in ("single", "bulk")}
    clients = {kind: sorted(round(c, 2) for k, c, _ in accepted if k == kind)[-5:] for kind in ("single", "bulk")}
    print(f"storm: {len(results)} requests, {refused} refused; longest batch {batch_s:.2f} s; slowest server "
          f"totals {report}; slowest as the clients saw them {clients}")
    for kind, bound in (("single", QUERY_BOUND_S), ("bulk", BULK_BOUND_S)):
        mine = [timing for k, _, timing in accepted if k == kind]
        if kind == "bulk" and not mine:
            # With the machine loaded from outside as well (other jobs on the same two cores), the engine can
            # be too slow for any bulk request to fit its bound: refusing them all is the promise kept.
            assert any(k == "bulk" and status == 429 for k, status, _, _ in results)
            continue
        assert mine, f"some {kind} requests are accepted"
        late = [(round(t["tokenize"] + t["queue"] + t["inference"], 2),
                 {k: round(v, 2) for k, v in t.items() if k != "total"})
                for t in mine if t["tokenize"] + t["queue"] + t["inference"] > bound + batch_s]
        assert not late, f"{kind}: {len(late)} of {len(mine)} waited past {bound} s + one batch ({batch_s:.2f} s): " \
                         f"{late}; slowest totals: {report}"
        over = [round(t["total"], 2) for t in mine if t["total"] > bound + 2 * batch_s]
        assert not over, f"{kind}: answered past {bound} s + two batches ({batch_s:.2f} s each): {over}"

    ok = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "after the storm"}, timeout=60)
    assert ok.status_code == 200, "the server serves normally afterwards"
