"""The gateway's cost: the same work sent straight to a runtime and through `embedfleet gateway`.

One `embedfleet serve` (default model) and one gateway in front of it, both as users start them.
Two figures, each measured direct and through the gateway in interleaved rounds of one run, so that
a neighbour's load on a small machine shifts both alike:

- latency at concurrency 1: one short query at a time on one keep-alive connection per side, the
  two sides taking turns query by query (p50, p99; the overhead is the median of the paired
  differences, which a neighbour's load shifts far less than either p50);
- throughput at `--concurrency` closed-loop clients (aiohttp, one keep-alive pool) sending short
  queries, one to four per request: requests per second;
- backfill throughput: `--backfill-concurrency` closed-loop clients sending large requests
  (`--backfill-inputs` passages each, bulk by size): passages per second.

Prints one JSON line, also appended to bench/results/gateway-cpu.jsonl: the figures direct and via the
gateway, the latency overhead (ms) and ratio (gateway / direct), the throughput ratios (gateway / direct;
1.0 is free; the goal for the backfill: >= 0.97), the 429s each side got (honoured, then resent), and the
CPU. On a small machine the gateway shares the cores with the runtime and the clients, so the throughput
ratio also counts the CPU the gateway takes from the runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

import aiohttp
import httpx
import numpy as np

from _common import ROOT, SOURCE_PATHS, Server, add_results_dir, corpus, free_port, pinned_to, record, wait_ready
from embedfleet.runtime.settings import DEFAULT_MODEL_NAME

QUERY = "how do I reset the password on my account from a phone"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


class Gateway:
    """`embedfleet gateway` in front of `upstream` (one replica URL, or several), as a user starts it."""

    def __init__(self, upstream: str | list[str], *flags: str, cpus: set[int] | None = None) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS))
        replicas = [upstream] if isinstance(upstream, str) else upstream
        upstreams = [f for url in replicas for f in ("--upstream", f"{DEFAULT_MODEL_NAME}={url}")]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embedfleet.runtime.cli", "gateway", "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "warning", *upstreams, *flags],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned_to(cpus))
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_ready(self.url, self.proc, timeout=60)
            # ready once started; wait for its first poll to find the runtime
            wait_ready(self.url, self.proc, path="/v1/models", timeout=60)
            while httpx.get(f"{self.url}/gateway/load").json()["deployments"][DEFAULT_MODEL_NAME]["ready_replicas"] \
                    < len(replicas):
                time.sleep(0.05)
        except BaseException:
            self.proc.kill()
            self.proc.wait(30)
            raise

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def latencies(clients: list[httpx.Client], n: int) -> list[list[float]]:
    """`n` single queries on each client, taking turns query by query (so each pair of samples saw the
    same machine); one list of seconds per client."""
    body = json.dumps({"model": DEFAULT_MODEL_NAME, "input": QUERY}).encode()
    headers = {"content-type": "application/json"}
    out: list[list[float]] = [[] for _ in clients]
    for i in range(n):
        turn = list(enumerate(clients)) if i % 2 == 0 else list(reversed(list(enumerate(clients))))
        for k, client in turn:
            t0 = time.perf_counter()
            r = client.post("/v1/embeddings", content=body, headers=headers)
            r.read()
            out[k].append(time.perf_counter() - t0)
            r.raise_for_status()
    return out


async def throughput(url: str, bodies: list[bytes], concurrency: int) -> tuple[float, int]:
    """Requests per second of `concurrency` closed-loop clients sending `bodies` (each answered once),
    and how many 429s they got on the way (each honoured as the OpenAI SDK does: wait Retry-After, resend)."""
    queue = list(reversed(bodies))
    headers = {"content-type": "application/json"}
    shed = 0
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=0)) as http:
        async def client() -> None:
            nonlocal shed
            while queue:
                body = queue.pop()
                while True:
                    async with http.post("/v1/embeddings", data=body, headers=headers) as resp:
                        await resp.read()
                        if resp.status == 200:
                            break
                        if resp.status != 429:
                            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
                        shed += 1
                        await asyncio.sleep(float(resp.headers.get("retry-after", "1")))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return len(bodies) / (time.perf_counter() - t0), shed


def measure(reps: int, rounds: int, warmup: int, concurrency: int, batch_requests: int, backfill_concurrency: int,
            backfill_requests: int, backfill_inputs: int) -> dict:
    rng = random.Random(0)
    passages = corpus(2000)
    texts = [t for t in passages if len(t.split()) <= 12]  # queries: the gateway's cost, not the engine's
    bodies = [json.dumps({"model": DEFAULT_MODEL_NAME,
                          "input": rng.sample(texts, rng.choice((1, 1, 1, 2, 4)))}).encode()
              for _ in range(batch_requests)]
    large = [json.dumps({"model": DEFAULT_MODEL_NAME, "input": rng.sample(passages, backfill_inputs)}).encode()
             for _ in range(backfill_requests)]
    backfill = {"direct": [], "gateway": []}
    server = Server()
    gateway = None
    lat = {"direct": [], "gateway": []}
    rps = {"direct": [], "gateway": []}
    shed = {"direct": 0, "gateway": 0}
    try:
        gateway = Gateway(server.url)
        urls = {"direct": server.url, "gateway": gateway.url}
        with httpx.Client(base_url=server.url, timeout=60) as d, httpx.Client(base_url=gateway.url, timeout=60) as g:
            latencies([d, g], warmup)
            for side in ("direct", "gateway"):
                asyncio.run(throughput(urls[side], bodies[:concurrency * 2], concurrency))
            per_round = max(1, reps // rounds)
            for i in range(rounds):
                direct, via = latencies([d, g], per_round)
                lat["direct"] += direct
                lat["gateway"] += via
                order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
                for side in order:
                    rate, refused = asyncio.run(throughput(urls[side], bodies, concurrency))
                    rps[side].append(rate)
                    shed[side] += refused
                for side in order:
                    rate, refused = asyncio.run(throughput(urls[side], large, backfill_concurrency))
                    backfill[side].append(rate * backfill_inputs)
                    shed[side] += refused
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()

    def ms(samples: list[float], q: float) -> float:
        return round(float(np.percentile(np.array(samples) * 1000, q)), 3)

    d50, g50 = statistics.median(lat["direct"]) * 1000, statistics.median(lat["gateway"]) * 1000
    paired = statistics.median(g - d for d, g in zip(lat["direct"], lat["gateway"], strict=True)) * 1000
    drps, grps = statistics.median(rps["direct"]), statistics.median(rps["gateway"])
    dbf, gbf = statistics.median(backfill["direct"]), statistics.median(backfill["gateway"])
    return {"figure": "gateway", "model": DEFAULT_MODEL_NAME, "reps": len(lat["gateway"]), "rounds": rounds,
            "direct_p50_ms": round(d50, 3), "direct_p99_ms": ms(lat["direct"], 99),
            "gateway_p50_ms": round(g50, 3), "gateway_p99_ms": ms(lat["gateway"], 99),
            "latency_overhead_ms": round(paired, 3), "latency_ratio": round(g50 / d50, 3),
            "concurrency": concurrency, "requests_per_round": len(bodies),
            "direct_rps": round(drps, 1), "gateway_rps": round(grps, 1), "throughput_ratio": round(grps / drps, 3),
            "backfill_concurrency": backfill_concurrency, "backfill_inputs_per_request": backfill_inputs,
            "backfill_requests_per_round": len(large), "direct_backfill_passages_per_s": round(dbf, 1),
            "gateway_backfill_passages_per_s": round(gbf, 1), "backfill_ratio": round(gbf / dbf, 3),
            "backfill_goal": ">= 0.97",
            "direct_429": shed["direct"], "gateway_429": shed["gateway"],
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "cpu": cpu_name()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=300, help="timed single queries per side, over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="alternate direct and gateway this many times")
    p.add_argument("--warmup", type=int, default=20, help="untimed queries per side before the first round")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients for the throughput figure")
    p.add_argument("--requests", type=int, default=600, help="requests per side per round for the throughput figure")
    p.add_argument("--backfill-concurrency", type=int, default=4, help="closed-loop clients sending large requests")
    p.add_argument("--backfill-requests", type=int, default=40, help="large requests per side per round")
    p.add_argument("--backfill-inputs", type=int, default=64, help="passages per large request")
    add_results_dir(p, "gateway-cpu.jsonl")
    a = p.parse_args()
    row = measure(a.reps, a.rounds, a.warmup, a.concurrency, a.requests, a.backfill_concurrency,
                  a.backfill_requests, a.backfill_inputs)
    print(json.dumps(row))
    record("gateway", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
