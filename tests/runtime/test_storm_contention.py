"""Admission keeps its promise when another process takes a core away from the engine.

A real `embedfleet serve` on both cores, a CPU hog pinned (sched_setaffinity) to one of them from
after start-up for the whole storm, and a storm of closed-loop clients in this process: lone queries
and bulk requests of 8 and 32 inputs. The server keeps both cores, as a pod beside a busy neighbour
does, so the engine's threads share the hog's core and run at the pace of the slower one: its speed
measured at start-up (the warm-up batch, before the hog) is out of date from the first request, and
it stays erratic (from a fraction of a second to seconds per batch) throughout.

The promise: an accepted request is answered within its class's bound plus one batch, and every
other one is refused with 429 and Retry-After; no 5xx, no time-out. "One batch" is the longest
engine batch the server reported for the answers it gave (`server-timing` inference: the engine
time of the batch a lone query ran in). The latency checked is what admission promises, as the server
timed it (`server-timing` tokenize + queue + inference: from the request being whole to the end of its
last batch; encoding the answer afterwards, on a core shared with the hog, is the server's work but not
queue wait), and the server's whole time must stay within that and one more batch. The clients share the two cores with
the server and the hog, so what they see also holds their own event loop's delays, which the
server cannot promise anything about; the client's figure is checked against the server's allowance
(the bound and two batches) plus a margin for them.
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
CLIENT_MARGIN_S = 2.0  # the clients' own delays on two cores shared with the server and the hog
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
    # The longest batch, as the server timed it: a lone query runs in one batch, so its engine time is that
    # batch's; a bulk request's is the sum of its batches, which bounds any one of them from above.
    longest = {"single": max((t["inference"] for k, _, t in accepted if k == "single"), default=0.0),
               "bulk": max(t["inference"] for _, _, t in accepted)}
    report = {kind: sorted(round(timing["total"], 2) for k, _, timing in accepted if k == kind)[-5:]
              for kind in ("single", "bulk")}
    for kind, bound in (("single", QUERY_BOUND_S), ("bulk", BULK_BOUND_S)):
        mine = [(client_s, timing) for k, client_s, timing in accepted if k == kind]
        batch_s = longest[kind]
        if kind == "bulk" and not mine:
            # With the machine loaded from outside as well (other jobs on the same two cores), the engine can
            # be too slow for any bulk request to fit its bound: refusing them all is the promise kept.
            assert any(k == "bulk" and status == 429 for k, status, _, _ in results)
            continue
        assert mine, f"some {kind} requests are accepted"
        waited = [t["tokenize"] + t["queue"] + t["inference"] for _, t in mine]
        late = [(round(w, 2), {k: round(v, 2) for k, v in t.items() if k != "total"})
                for w, (_, t) in zip(waited, mine, strict=True) if w > bound + batch_s]
        assert not late, f"{kind}: {len(late)} of {len(mine)} ran past {bound} s + one batch ({batch_s:.2f} s): " \
                         f"{late}; slowest totals: {report}"
        over = [round(t["total"], 2) for _, t in mine if t["total"] > bound + 2 * batch_s]
        assert not over, f"{kind}: answered past {bound} s + two batches ({batch_s:.2f} s each): {over}"
        # the client's figure holds the server's whole time (allowed bound + two batches, above) and the
        # clients' own delays: checked against the same allowance plus their margin, with the server's figure
        slow = [(round(client_s, 2), round(t["total"], 2)) for client_s, t in mine
                if client_s > bound + 2 * batch_s + CLIENT_MARGIN_S]
        assert not slow, f"{kind}: clients waited (client s, server s) {slow} (bound {bound} s, batch {batch_s:.2f} s)"

    ok = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "after the storm"}, timeout=60)
    assert ok.status_code == 200, "the server serves normally afterwards"
