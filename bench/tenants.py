"""Two tenants: one runs a backfill at full speed, the other sends queries. Are the queries hurt?

One `embedfleet serve --api-keys` with tenant `search` (interactive) and tenant `backfill` (batch).
Phase 1: `search` alone sends lone queries one at a time (its idle latency). Phase 2: `backfill`
keeps `--backfill-concurrency` requests of 32 passages in flight the whole time while `search` sends
the same queries again. Both phases in one run, one server.

The backfill runs in its own process (aiohttp, bodies read but not parsed) so that its client work
never delays the query client's event loop: on a shared machine that would be counted as the
server's latency. Its tokens/s come from the server's `embedfleet_tenant_tokens_total`. Queries go
one at a time over one keep-alive connection (http.client, the leanest client), with the server's own
time for each (`server-timing`), split into the wait for the engine and the query's own forward pass.

Prints one JSON line, also appended to bench/results/tenants-cpu.jsonl: the query p50/p99 idle and under the
backfill as the client saw them and as the server timed them, the ratios (the goal: p99 under backfill
<= 2x idle p99), the backfill's tokens/s during phase 2 and its 429s.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

from _common import Server, add_results_dir, corpus, percentiles, record
from embedfleet.gateway.upstreams import server_timing

SEARCH_KEY = "sk-bench-search-000000000001"
BACKFILL_KEY = "sk-bench-backfill-0000000001"


def queries(port: int, texts: list[str], n: int, refused: list[str] | None = None,
            parts: dict[str, list[float]] | None = None) -> tuple[list[float], list[float]]:
    """Client and server latencies of `n` lone queries answered 200; a 429 is recorded in `refused`,
    and the server's split of each answered query's time (queue, inference) in `parts`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"authorization": f"Bearer {SEARCH_KEY}", "content-type": "application/json"}
    client, server = [], []
    try:
        for i in range(n):
            body = json.dumps({"input": texts[i % len(texts)]}).encode()
            started = time.perf_counter()
            conn.request("POST", "/v1/embeddings", body, headers)
            resp = conn.getresponse()
            data = resp.read()
            took = time.perf_counter() - started
            if resp.status == 200:
                client.append(took)
                timing = server_timing(resp.getheader("server-timing"))
                server.append(timing["total"])
                if parts is not None:
                    for name in ("queue", "inference"):
                        parts.setdefault(name, []).append(timing[name])
            else:
                assert resp.status == 429, data
                if refused is not None:
                    refused.append(json.loads(data)["error"]["message"])
            time.sleep(0.01)  # a user's think time: queries are independent arrivals
    finally:
        conn.close()
    return client, server


def backfill(url: str, texts: list[str], stop, concurrency: int, refused) -> None:
    """In its own process until `stop` is set: `concurrency` requests of 32 passages always in flight."""

    async def main() -> None:
        headers = {"authorization": f"Bearer {BACKFILL_KEY}"}
        async with aiohttp.ClientSession(base_url=url, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=300)) as http:
            async def one(k: int) -> None:
                i = k
                while not stop.is_set():
                    batch = [texts[(i * 32 + j) % len(texts)] for j in range(32)]
                    async with http.post("/v1/embeddings", json={"input": batch}) as resp:
                        await resp.read()
                        if resp.status == 429:
                            refused.value += 1
                            await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                    i += concurrency

            await asyncio.gather(*(one(k) for k in range(concurrency)))

    asyncio.run(main())


def tenant_tokens(url: str, tenant: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "embedfleet_tenant_tokens_total" and s.labels.get("tenant") == tenant)


def scenario(srv: Server, n: int, concurrency: int) -> dict:
    texts = corpus(4000)
    short = [t for t in texts if len(t.split()) <= 12][:200]
    queries(srv.port, short, 20)  # warm-up
    idle_parts: dict[str, list[float]] = {}
    loaded_parts: dict[str, list[float]] = {}
    idle, idle_server = queries(srv.port, short, n, parts=idle_parts)
    ctx = multiprocessing.get_context("spawn")
    stop, refused = ctx.Event(), ctx.Value("i", 0)
    proc = ctx.Process(target=backfill, args=(srv.url, texts, stop, concurrency, refused))
    proc.start()
    try:
        time.sleep(5.0)  # the backfill's process is up and its queue full before queries are timed
        started, tokens_before = time.perf_counter(), tenant_tokens(srv.url, "backfill")
        query_refused: list[str] = []
        loaded, loaded_server = queries(srv.port, short, n, query_refused, loaded_parts)
        seconds = time.perf_counter() - started
        tokens = tenant_tokens(srv.url, "backfill") - tokens_before
    finally:
        stop.set()
        proc.join(120)
    assert tokens > 0, "the backfill ran nothing while the queries were timed"
    return {"idle": percentiles(idle), "loaded": percentiles(loaded),
            "idle_server": percentiles(idle_server), "loaded_server": percentiles(loaded_server),
            # where a query's server time went: waiting for the batch in the engine, its own forward pass
            "idle_queue": percentiles(idle_parts["queue"]), "loaded_queue": percentiles(loaded_parts["queue"]),
            "idle_inference": percentiles(idle_parts["inference"]),
            "loaded_inference": percentiles(loaded_parts["inference"]),
            "backfill_tokens_per_s": round(tokens / seconds, 1), "backfill_429": refused.value,
            "query_429": len(query_refused), "query_429_example": query_refused[:1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--backfill-concurrency", type=int, default=4)
    p.add_argument("--server-flag", action="append", default=[], help="extra flag for `embedfleet serve`")
    add_results_dir(p, "tenants-cpu.jsonl")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text(f"tenants:\n  - name: search\n    keys: [\"{SEARCH_KEY}\"]\n"
                        f"  - name: backfill\n    keys: [\"{BACKFILL_KEY}\"]\n    priority: batch\n")
        srv = Server("--api-keys", str(keys), *a.server_flag)
        try:
            result = scenario(srv, a.queries, a.backfill_concurrency)
        finally:
            srv.stop()
    ratio = result["loaded"]["p99_ms"] / result["idle"]["p99_ms"]
    server_ratio = result["loaded_server"]["p99_ms"] / result["idle_server"]["p99_ms"]
    row = {"figure": "tenants", "queries": a.queries, "backfill_concurrency": a.backfill_concurrency,
           "server_flags": a.server_flag, **result, "p99_loaded_over_idle": round(ratio, 2),
           "server_p99_loaded_over_idle": round(server_ratio, 2), "goal": "<= 2.0"}
    print(json.dumps(row))
    record("tenants", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
