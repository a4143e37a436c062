"""Least expected wait vs round-robin when one replica is busy: the p99 of queries through the gateway.

Two `embedfleet serve` (default model, `--num-threads 1` each, as two small replicas) and two
gateways in front of both, as users start them: one `--balance least-wait` (the default), one
`--balance round-robin` (a baseline, never for serving). Replica A runs a long backfill the whole
time: `--backfill-concurrency` bulk requests of 32 passages (`X-Priority: bulk`) always in flight,
sent straight to it from their own process (never through a gateway). Queries (one short text each)
go through the gateways, taking turns query by query on one keep-alive connection each (http.client),
so a neighbour's load shifts both alike; a 10 ms think time between queries.

Two layouts, each a whole measurement in the same run:
- `separate` (2+ cores): the busy replica alone on one core, as replicas run on machines of their own;
  the quiet replica, both gateways, the query client and the backfill's client share the rest. The
  ratio then measures the routing: what a query costs where the gateway sends it.
- `shared`: every process on every core. On a machine with fewer cores than the two replicas, the
  backfill's client, the gateways and the query client need, the quiet replica is slowed by the busy
  one's CPU use, and the ratio measures that contention as much as the routing.

Prints one JSON line, also appended to bench/results/gateway-skew-cpu.jsonl: per layout, the queries'
p50/p90/p99 through each gateway, the ratio of the p99s (least-wait / round-robin; the goal: <= 0.5), the
share of least-wait's queries that went to the quiet replica, the queries each side got refused and the
backfill's 429s; the headline `p99_ratio` is the `separate` layout's (the `shared` one's where there is one
core), and the CPU.
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

from _common import Server, add_results_dir, corpus, percentiles, record
from embedfleet.runtime.settings import DEFAULT_MODEL_NAME
from gateway import Gateway, cpu_name

SIDES = ("least_wait", "round_robin")


def backfill(url: str, texts: list[str], stop, concurrency: int, refused, cpus: set[int] | None = None) -> None:
    """In its own process until `stop` is set: `concurrency` bulk requests of 32 passages in flight."""
    if cpus:
        os.sched_setaffinity(0, cpus)

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


def layouts(cpus: set[int]) -> dict[str, tuple[set[int] | None, set[int] | None]]:
    """Where the busy replica and everything else run. `separate` (with 2+ cores): the busy replica alone
    on one core, as on a machine of its own; the quiet replica, both gateways, the query client and the
    backfill's client share the other core(s). `shared`: every process on every core."""
    out: dict[str, tuple[set[int] | None, set[int] | None]] = {}
    if len(cpus) >= 2:
        first = min(cpus)
        out["separate"] = ({first}, cpus - {first})
    out["shared"] = (None, None)
    return out


def measure(n: int, concurrency: int, warmup_s: float, server_flags: list[str],
            busy_cpus: set[int] | None = None, rest_cpus: set[int] | None = None) -> dict:
    texts = corpus(4000)
    short = [t for t in texts if len(t.split()) <= 12][:300]
    flags = ("--num-threads", "1", "--tokenizer-workers", "1", *server_flags)
    mine = os.sched_getaffinity(0)
    if rest_cpus:
        os.sched_setaffinity(0, rest_cpus)  # the query client
    busy, quiet = Server(*flags, cpus=busy_cpus), None
    gateways: dict[str, Gateway] = {}
    proc = None
    ctx = multiprocessing.get_context("spawn")
    stop, backfill_429 = ctx.Event(), ctx.Value("i", 0)
    try:
        quiet = Server(*flags, cpus=rest_cpus)
        for side in SIDES:
            gateways[side] = Gateway([busy.url, quiet.url], "--balance", side.replace("_", "-"), cpus=rest_cpus)
        urls = {side: g.url for side, g in gateways.items()}
        queries(urls, short, 20)  # warm-up, before the backfill
        proc = ctx.Process(target=backfill, args=(busy.url, texts, stop, concurrency, backfill_429, rest_cpus))
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
        os.sched_setaffinity(0, mine)
    lw, rr = percentiles(seconds["least_wait"]), percentiles(seconds["round_robin"])
    return {"least_wait": lw, "round_robin": rr, "p99_ratio": round(lw["p99_ms"] / rr["p99_ms"], 3),
            # round-robin sends every other query to the quiet replica; the rest of its count is least-wait's
            "least_wait_share_on_quiet": round((on_quiet - n / 2) / n, 3),
            "query_not_200": refused, "backfill_429": backfill_429.value,
            "busy_replica_cpus": sorted(busy_cpus) if busy_cpus else "all",
            "other_processes_cpus": sorted(rest_cpus) if rest_cpus else "all"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=300, help="timed queries per gateway")
    p.add_argument("--backfill-concurrency", type=int, default=4, help="bulk requests in flight on the busy replica")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of backfill before queries are timed")
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra flag for both `embedfleet serve` (e.g. --server-flag=--shared-batch-seconds=0)")
    add_results_dir(p, "gateway-skew-cpu.jsonl")
    a = p.parse_args()
    cpus = os.sched_getaffinity(0)
    runs = {name: measure(a.queries, a.backfill_concurrency, a.warmup, a.server_flag, *where)
            for name, where in layouts(cpus).items()}
    headline = runs.get("separate", runs["shared"])
    row = {"figure": "gateway_skew", "model": DEFAULT_MODEL_NAME, "queries_per_side": a.queries,
           "backfill_concurrency": a.backfill_concurrency, "server_flags": a.server_flag,
           "p99_ratio": headline["p99_ratio"], "p99_ratio_layout": "separate" if "separate" in runs else "shared",
           "goal": "<= 0.5", **runs, "cpus": len(cpus), "cpu": cpu_name()}
    print(json.dumps(row))
    record("gateway-skew", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
