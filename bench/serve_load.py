"""Load generator against a running OpenAI-compatible server (ours, or Infinity, or TEI).

backfill: the corpus in natural order, requests of N inputs, C in flight -> embeddings/s.
online: single short queries at concurrency 1 and 16 -> p50/p90/p99 latency.
Prints one JSON line, also appended to bench/results/serve_load-cpu.jsonl (the row names the --url it
loaded). With no --url it starts `embedfleet serve` itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import orjson

from _common import Server, add_results_dir, corpus, percentiles, record

HEADERS = {"content-type": "application/json"}


async def backfill(url: str, model: str, texts: list[str], n_per_request: int, concurrency: int,
                   path: str = "/v1/embeddings") -> dict:
    chunks = [texts[i:i + n_per_request] for i in range(0, len(texts), n_per_request)]
    queue: asyncio.Queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    done = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(600)) as client:
        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                chunk = queue.get_nowait()
                body = orjson.dumps({"model": model, "input": chunk, "encoding_format": "base64"})
                async with client.post(path, data=body, headers=HEADERS) as resp:
                    resp.raise_for_status()
                    assert len(orjson.loads(await resp.read())["data"]) == len(chunk)
                done += len(chunk)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"embeddings_per_s": round(done / elapsed, 2), "inputs": done, "seconds": round(elapsed, 2),
            "inputs_per_request": n_per_request, "concurrency": concurrency}


async def online(url: str, model: str, concurrency: int, requests: int, path: str = "/v1/embeddings") -> dict:
    samples, elapsed = await online_samples(url, model, concurrency, requests, path)
    return {"concurrency": concurrency, "requests_per_s": round(requests / elapsed, 2), **percentiles(samples)}


async def online_samples(url: str, model: str, concurrency: int, requests: int,
                         path: str = "/v1/embeddings") -> tuple[list[float], float]:
    """Each short query's seconds as the client saw it, and the seconds all of them took."""
    samples: list[float] = []
    queries = [f"how do I reset my password {i}" for i in range(requests)]
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(60)) as client:
        for q in queries[:10]:  # warm the connection pool and the server
            async with client.post(path, data=orjson.dumps({"model": model, "input": q}), headers=HEADERS) as r:
                await r.read()
        sem = asyncio.Semaphore(concurrency)

        async def one(q: str) -> None:
            body = orjson.dumps({"model": model, "input": q})
            async with sem:
                t0 = time.perf_counter()
                async with client.post(path, data=body, headers=HEADERS) as resp:
                    await resp.read()
                samples.append(time.perf_counter() - t0)
                resp.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(one(q) for q in queries))
        elapsed = time.perf_counter() - started
    return samples, elapsed


def measure(url: str | None, model: str, n: int, per_request: int, concurrency: int, flags: list[str],
            path: str = "/v1/embeddings") -> dict:
    server = Server(*flags) if url is None else None
    url = url or server.url
    try:
        texts = corpus(n)
        result = {"figure": "serve_load", "url": url, "model": model,
                  "backfill": asyncio.run(backfill(url, model, texts, per_request, concurrency, path)),
                  "online_c1": asyncio.run(online(url, model, 1, 300, path)),
                  "online_c16": asyncio.run(online(url, model, 16, 600, path))}
    finally:
        if server:
            server.stop()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", help="a running server; default: start `embedfleet serve`")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--inputs-per-request", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--path", default="/v1/embeddings", help="embeddings route (Infinity: /embeddings)")
    p.add_argument("--server-flag", action="append", default=[], help="extra flag for `embedfleet serve`")
    add_results_dir(p, "serve_load-cpu.jsonl")
    a = p.parse_args()
    row = measure(a.url, a.model, a.n, a.inputs_per_request, a.concurrency, a.server_flag, a.path)
    print(json.dumps(row))
    record("serve_load", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
