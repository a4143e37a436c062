"""Async backfill vs. sync backfill on one server, and sync latency while an async backfill runs.

Starts a real redis-server and one runtime replica (API + in-process worker) and prints one JSON line, also
appended to bench/results/async_backfill-cpu.jsonl:
  async_over_sync      async backfill inputs/s (jobs of 64 inputs, submit -> all succeeded)
                       / sync backfill inputs/s (requests of 64 inputs, same texts' shape)   goal >= 0.9
  loaded_over_idle     sync single-query p99 while the async backfill saturates the server
                       / the same p99 on the idle server                                     goal <= 2
Usage: python3 bench/async_backfill.py [--jobs 32] [--rounds 3] [--queries 200] [--serve-arg=--flag=value]
                                       [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "runtime")]

import httpx  # noqa: E402
from tests.asyncq.procs import start_redis  # noqa: E402
from tests.procs import start_runtime  # noqa: E402

from _common import add_results_dir, record  # noqa: E402
from embedfleet.runtime.asyncq.keys import Keys  # noqa: E402

WORDS = ("vector search embedding batch token model queue latency backfill replica cluster worker result "
         "signal metric budget stream webhook cache digest scale").split()


def corpus(jobs: int, seed: int, size: int = 64) -> list[list[str]]:
    rnd = random.Random(seed)
    return [[" ".join(rnd.choices(WORDS, k=rnd.randint(8, 40))) for _ in range(size)] for _ in range(jobs)]


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def sync_backfill(url: str, batches: list[list[str]], concurrency: int) -> float:
    queue = list(batches)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def lane() -> None:
            while queue:
                body = {"input": queue.pop()}
                response = await client.post("/v1/embeddings", json=body)
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return sum(len(b) for b in batches) / (time.perf_counter() - started)


async def async_backfill(url: str, redis_client, batches: list[list[str]]) -> float:
    done0 = int(redis_client.hget(Keys().stats, "succeeded") or 0)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        for batch in batches:
            response = await client.post("/async/v1/embeddings", json={"input": batch})
            assert response.status_code == 202, response.text
    while int(redis_client.hget(Keys().stats, "succeeded") or 0) - done0 < len(batches):
        await asyncio.sleep(0.05)
    return sum(len(b) for b in batches) / (time.perf_counter() - started)


async def single_queries(url: str, n: int | None, until: asyncio.Event | None = None) -> list[float]:
    samples: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        i = 0
        while (n is None or i < n) and not (until is not None and until.is_set()):
            started = time.perf_counter()
            response = await client.post("/v1/embeddings", json={"input": f"what is the latency of query {i}?"})
            response.raise_for_status()
            samples.append(time.perf_counter() - started)
            i += 1
    return samples


async def main(args: argparse.Namespace) -> dict:
    redis_server = start_redis(appendonly=True)
    srv = start_runtime("--redis-url", redis_server.url, "--log-level", "warning", *args.serve_arg)
    try:
        r = redis_server.client()
        await sync_backfill(srv.url, corpus(4, 0), 2)  # warm up both paths
        await async_backfill(srv.url, r, corpus(4, 1))
        sync_rates, async_rates = [], []
        for k in range(args.rounds):  # alternate, so drift in a shared machine's load hits both alike
            sync_rates.append(await sync_backfill(srv.url, corpus(args.jobs, 10 + k), args.sync_concurrency))
            async_rates.append(await async_backfill(srv.url, r, corpus(args.jobs, 20 + k)))
        idle = await single_queries(srv.url, args.queries)
        finished = asyncio.Event()

        async def backfill() -> None:
            try:
                await async_backfill(srv.url, r, corpus(args.jobs * 2, 4))
            finally:
                finished.set()

        task = asyncio.create_task(backfill())
        while float(srv.metric("embedfleet_queue_tokens")) == 0 and not finished.is_set():
            await asyncio.sleep(0.05)  # measure only while the backfill is really in the engine's queue
        loaded = await single_queries(srv.url, None, finished)
        await task
        sync_rate, async_rate = statistics.median(sync_rates), statistics.median(async_rates)
        return {
            "bench": "async_backfill", "inputs_per_job": 64, "jobs": args.jobs, "rounds": args.rounds,
            "cores": os.cpu_count(), "serve_args": " ".join(args.serve_arg),
            "sync_backfill_inputs_per_s": round(sync_rate, 1), "async_backfill_inputs_per_s": round(async_rate, 1),
            "async_over_sync": round(async_rate / sync_rate, 3),
            "idle_p50_ms": round(statistics.median(idle) * 1000, 2), "idle_p99_ms": round(p99(idle) * 1000, 2),
            "loaded_p50_ms": round(statistics.median(loaded) * 1000, 2), "loaded_p99_ms": round(p99(loaded) * 1000, 2),
            "loaded_samples": len(loaded), "loaded_over_idle": round(p99(loaded) / p99(idle), 3),
        }
    finally:
        srv.stop()
        redis_server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=32, help="jobs (and sync requests) of 64 inputs per backfill")
    parser.add_argument("--queries", type=int, default=200, help="single queries for the idle p99")
    parser.add_argument("--sync-concurrency", type=int, default=4, help="parallel requests of the sync backfill")
    parser.add_argument("--rounds", type=int, default=3, help="alternating sync/async backfills; medians reported")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra flag for `embedfleet serve` (repeat), e.g. --serve-arg=--max-batch-requests=8")
    add_results_dir(parser, "async_backfill-cpu.jsonl")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parser.parse_args()
    row = asyncio.run(main(args))
    print(json.dumps(row))
    record("async_backfill", row, results_dir=args.results_dir)
