"""Two tenants: one runs a backfill at full speed, the other sends queries. Are the queries hurt?

One `embedfleet serve --api-keys` with tenant `search` (interactive) and tenant `backfill` (batch).
Phase 1: `search` alone sends lone queries one at a time (its idle latency). Phase 2: `backfill`
keeps `--backfill-concurrency` requests of 32 passages in flight the whole time while `search` sends
the same queries again. Both phases in one run, one server.

Prints one JSON line: the query p50/p99 idle and under the backfill, their ratio (the issue's goal:
p99 under backfill <= 2x idle p99), the backfill's tokens/s during phase 2 and its 429s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from _common import Server, corpus, percentiles

SEARCH_KEY = "sk-bench-search-000000000001"
BACKFILL_KEY = "sk-bench-backfill-0000000001"


async def queries(url: str, texts: list[str], n: int, refused: list[str] | None = None) -> list[float]:
    """Latencies of `n` lone queries answered 200; a 429 is recorded in `refused` (not retried)."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"authorization": f"Bearer {SEARCH_KEY}"}) as http:
        for i in range(n):
            started = time.perf_counter()
            resp = await http.post("/v1/embeddings", json={"input": texts[i % len(texts)]})
            if resp.status_code == 200:
                out.append(time.perf_counter() - started)
            else:
                assert resp.status_code == 429, resp.text
                if refused is not None:
                    refused.append(resp.json()["error"]["message"])
            await asyncio.sleep(0.01)  # a user's think time: queries are independent arrivals
    return out


async def backfill(url: str, texts: list[str], stop: asyncio.Event, concurrency: int, stats: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"authorization": f"Bearer {BACKFILL_KEY}"}) as http:
        async def one(k: int) -> None:
            i = k
            while not stop.is_set():
                batch = [texts[(i * 32 + j) % len(texts)] for j in range(32)]
                resp = await http.post("/v1/embeddings", json={"input": batch})
                if resp.status_code == 200:
                    stats["tokens"] += resp.json()["usage"]["total_tokens"]
                elif resp.status_code == 429:
                    stats["refused"] += 1
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                i += concurrency

        await asyncio.gather(*(one(k) for k in range(concurrency)))


async def scenario(url: str, n: int, concurrency: int) -> dict:
    texts = corpus(4000)
    short = [t for t in texts if len(t.split()) <= 12][:200]
    await queries(url, short, 20)  # warm-up
    idle = await queries(url, short, n)
    stop, stats = asyncio.Event(), {"tokens": 0, "refused": 0}
    task = asyncio.create_task(backfill(url, texts, stop, concurrency, stats))
    await asyncio.sleep(3.0)  # the backfill's queue is full before queries are timed
    started, tokens_before = time.perf_counter(), stats["tokens"]
    query_refused: list[str] = []
    loaded = await queries(url, short, n, query_refused)
    seconds = time.perf_counter() - started
    tokens = stats["tokens"] - tokens_before
    stop.set()
    await task
    return {"idle": percentiles(idle), "loaded": percentiles(loaded),
            "backfill_tokens_per_s": round(tokens / seconds, 1), "backfill_429": stats["refused"],
            "query_429": len(query_refused), "query_429_example": query_refused[:1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--backfill-concurrency", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text(f"tenants:\n  - name: search\n    keys: [\"{SEARCH_KEY}\"]\n"
                        f"  - name: backfill\n    keys: [\"{BACKFILL_KEY}\"]\n    priority: batch\n")
        srv = Server("--api-keys", str(keys))
        try:
            result = asyncio.run(scenario(srv.url, a.queries, a.backfill_concurrency))
        finally:
            srv.stop()
    ratio = result["loaded"]["p99_ms"] / result["idle"]["p99_ms"]
    print(json.dumps({"figure": "tenants", "queries": a.queries, "backfill_concurrency": a.backfill_concurrency,
                      **result, "p99_loaded_over_idle": round(ratio, 2), "goal": "<= 2.0"}))


if __name__ == "__main__":
    main()
