"""Least expected wait vs round-robin when one replica is busy: the p99 of queries through the gateway.

Two `embedfleet serve` (default model, `--num-threads 1` each, as two small replicas) and two
gateways in front of both, as users start them: one `--balance least-wait` (the default), one
`--balance round-robin` (a baseline, never for serving). Replica A runs a long backfill the whole
time: `--backfill-concurrency` bulk requests of 32 passages (`X-Priority: bulk`) always in flight,
sent straight to it from their own process (never through a gateway). Queries (one short text each)
go through the gateways, taking turns query by query on one keep-alive connection each (http.client),
so a neighbour's load shifts both alike; a 10 ms think time between queries.

Prints one JSON line: the queries' p50/p90/p99 through each gateway, the ratio of the p99s
(least-wait / round-robin; the issue's goal: <= 0.5), the share of least-wait's queries that went
to the quiet replica, the queries each side got refused, the backfill's 429s, and the CPU. On a
machine with fewer cores than the two replicas, the backfill's client, the gateways and the query
client need, the quiet replica is slowed by the busy one's CPU use, and the ratio measures that
contention as much as the routing.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import time
from urllib.parse import urlsplit

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from _common import Server, corpus, percentiles
from embedfleet.runtime.settings import DEFAULT_MODEL_NAME
from gateway import Gateway, cpu_name

SIDES = ("least_wait", "round_robin")


def backfill(url: str, texts: list[str], stop, concurrency: int, refused) -> None:
    """In its own process until `stop` is set: `concurrency` bulk requests of 32 passages in flight."""

    async def main() -> None:
        async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=300)) as http:
            async def one(k: int) -> None:
                i = k
                while not stop.is_set():
                    batch = [texts[(i * 32 + j) % len(texts)] for j in range(32)]
                    async with http.post("/v1/embeddings", json={"model": DEFAULT_MODEL_NAME, "input": batch},
                                         headers={"x-priority": "bulk"}) as resp:
                        await resp.read()
                        if resp.status == 429:
                            refused.value += 1
                            await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    i += concurrency

            await asyncio.gather(*(one(k) for k in range(concurrency)))

    asyncio.run(main())


def requests_answered(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "embedfleet_request_duration_seconds_count")


def queries(urls: dict[str, str], texts: list[str], n: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """`n` lone queries through each gateway, taking turns; seconds of those answered 200, and the
    count of the others, per side."""
    conns = {side: http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=120)
             for side, url in urls.items()}
    headers = {"content-type": "application/json"}
    seconds: dict[str, list[float]] = {side: [] for side in urls}
    refused = dict.fromkeys(urls, 0)
    try:
        for i in range(n):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            body = json.dumps({"model": DEFAULT_MODEL_NAME, "input": texts[i % len(texts)]}).encode()
            for side in order:
                started = time.perf_counter()
                conns[side].request("POST", "/v1/embeddings", body, headers)
                resp = conns[side].getresponse()
                resp.read()
                if resp.status == 200:
                    seconds[side].append(time.perf_counter() - started)
                else:
                    refused[side] += 1
                time.sleep(0.01)  # think time: queries are independent arrivals
    finally:
        for conn in conns.values():
            conn.close()
    return seconds, refused


def measure(n: int, concurrency: int, warmup_s: float, server_flags: list[str]) -> dict:
    texts = corpus(4000)
    short = [t for t in texts if len(t.split()) <= 12][:300]
    flags = ("--num-threads", "1", "--tokenizer-workers", "1", *server_flags)
    busy, quiet = Server(*flags), None
    gateways: dict[str, Gateway] = {}
    proc = None
    ctx = multiprocessing.get_context("spawn")
    stop, backfill_429 = ctx.Event(), ctx.Value("i", 0)
    try:
        quiet = Server(*flags)
        for side in SIDES:
            gateways[side] = Gateway([busy.url, quiet.url], "--balance", side.replace("_", "-"))
        urls = {side: g.url for side, g in gateways.items()}
        queries(urls, short, 20)  # warm-up, before the backfill
        proc = ctx.Process(target=backfill, args=(busy.url, texts, stop, concurrency, backfill_429))
        proc.start()
        time.sleep(warmup_s)  # the backfill's process is up and its queue full before queries are timed
        before = requests_answered(quiet.url)
        seconds, refused = queries(urls, short, n)
        on_quiet = requests_answered(quiet.url) - before
    finally:
        stop.set()
        if proc is not None:
            proc.join(120)
        for g in gateways.values():
            g.stop()
        for srv in (busy, quiet):
            if srv is not None:
                srv.stop()
    lw, rr = percentiles(seconds["least_wait"]), percentiles(seconds["round_robin"])
    return {"figure": "gateway_skew", "model": DEFAULT_MODEL_NAME, "queries_per_side": n,
            "backfill_concurrency": concurrency, "server_flags": server_flags, "least_wait": lw, "round_robin": rr,
            "p99_ratio": round(lw["p99_ms"] / rr["p99_ms"], 3), "goal": "<= 0.5",
            # round-robin sends every other query to the quiet replica; the rest of its count is least-wait's
            "least_wait_share_on_quiet": round((on_quiet - n / 2) / n, 3),
            "query_not_200": refused, "backfill_429": backfill_429.value,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu": cpu_name()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=300, help="timed queries per gateway")
    p.add_argument("--backfill-concurrency", type=int, default=4, help="bulk requests in flight on the busy replica")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of backfill before queries are timed")
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra flag for both `embedfleet serve` (e.g. --server-flag=--shared-batch-seconds=0)")
    a = p.parse_args()
    print(json.dumps(measure(a.queries, a.backfill_concurrency, a.warmup, a.server_flag)))


if __name__ == "__main__":
    main()
