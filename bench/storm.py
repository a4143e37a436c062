"""Overload storm: many clients, mixed requests, against a default `embedfleet serve`.

256 closed-loop clients for 20 s, each sending one request at a time: a lone query (60%), two to four
passages (25%, still urgent: --urgent-max-inputs is 4) or a bulk batch of 32 passages (15%, bounded by
--max-queue-seconds-bulk). A 429 is honoured as the OpenAI SDK does (sleep Retry-After, then go on);
a client gives up after 60 s. Before admission by expected wait, this storm got no 429s, 191 client
time-outs and a p99 of 59 s.

Prints one JSON line, also appended to bench/results/storm-cpu.jsonl: counts of 200/429/504/time-outs/other,
accepted p50/p99 per kind (`single`: the lone queries; `query`: two to four inputs; `bulk`), the mean engine
batch time from /metrics, and p99 / (bound + one batch) per kind (1.0 is the admission
promise met exactly; it is a behaviour figure, not a speed figure). The promise is per request: its bound
plus the batch it runs in, so each accepted request's client-side time is also divided by its bound plus
the engine time of the batches it ran in (`inference` of its server-timing): `over_own_promise` counts the
requests over it, `p99_over_own_promise` / `max_over_own_promise` are that ratio's p99 and maximum.
Each kind is measured twice: as the client saw it, and as the server timed it (`server-timing`, from
the gate's accepting the request to its answer). On one small machine the 256 clients share the cores
with the server, so the client's figure also holds the client's own delays (its event loop, the kernel's accept queue).
The clients use aiohttp, the lightest of the usual Python HTTP clients, to keep those delays small.

`--hog` adds a noisy neighbour: another process spinning on one of the machine's cores for the whole
storm (pinned there with sched_setaffinity), started once the server is ready, so the engine's speed
measured at start-up is out of date from the storm's first request. The server and the clients keep
every core, as a pod beside a busy neighbour does: the engine's threads share the hog's core and run
at the pace of the slower one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import aiohttp
import httpx
import numpy as np

from _common import Server, add_results_dir, corpus, metric, pinned_to, record
from embedfleet.gateway.upstreams import server_timing


def start_hog() -> subprocess.Popen:
    """A process that keeps one core (the last this process may use) busy until killed."""
    core = max(os.sched_getaffinity(0))
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned_to({core}))


def pick(rng: random.Random, texts: list[str]) -> tuple[str, list[str]]:
    r = rng.random()
    if r < 0.6:
        return "single", [rng.choice(texts)]
    if r < 0.85:
        return "query", rng.sample(texts, rng.randint(2, 4))
    return "bulk", rng.sample(texts, 32)


async def client(i: int, url: str, texts: list[str], until: float, client_timeout: float, out: list) -> None:
    rng = random.Random(i)
    timeout = aiohttp.ClientTimeout(total=client_timeout)
    async with aiohttp.ClientSession(base_url=url, timeout=timeout) as http:
        while time.monotonic() < until:
            kind, inputs = pick(rng, texts)
            started = time.monotonic()
            try:
                async with http.post("/v1/embeddings", json={"input": inputs}) as resp:
                    await resp.read()
                    status, headers = resp.status, resp.headers
            except TimeoutError:
                out.append((kind, "timeout", time.monotonic() - started, None, started, len(inputs), None))
                continue
            except aiohttp.ClientError as exc:
                out.append((kind, f"error:{type(exc).__name__}: {exc}"[:120], time.monotonic() - started, None, started,
                            len(inputs), None))
                continue
            timed = server_timing(headers.get("server-timing"))
            out.append((kind, status, time.monotonic() - started, timed.get("total"), started, len(inputs),
                        timed.get("inference")))
            if status == 429:
                wait = float(headers.get("retry-after", "1"))
                await asyncio.sleep(min(wait, max(0.0, until - time.monotonic())))


async def storm(url: str, clients: int, seconds: float, client_timeout: float) -> list:
    texts = corpus(2000)
    out: list = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(i, url, texts, until, client_timeout, out) for i in range(clients)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--hog", action="store_true", help="another process spins on one core for the whole storm")
    p.add_argument("--note", help="a note added to the JSON line (its run_meta already names the commit and machine)")
    p.add_argument("--raw", help="also write every request (kind, status, client s, server s, start, inputs, "
                                 "engine s of its batches) here")
    add_results_dir(p, "storm-cpu.jsonl")
    a = p.parse_args()
    from embedfleet.runtime.settings import RuntimeSettings

    defaults = RuntimeSettings()
    bounds = {"single": defaults.max_queue_seconds, "query": defaults.max_queue_seconds,
              "bulk": defaults.max_queue_seconds_bulk}
    srv = Server()
    hog = start_hog() if a.hog else None
    try:
        if hog is not None:
            time.sleep(1.0)  # the hog has its core before the first request
        started = time.monotonic()
        results = asyncio.run(storm(srv.url, a.clients, a.seconds, a.timeout))
        wall = time.monotonic() - started
        batches = metric(srv.url, "embedfleet_batch_size_count")
        batch_s = metric(srv.url, "embedfleet_engine_busy_seconds_total") / max(batches, 1)
        after = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "after the storm"}, timeout=60).status_code
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        srv.stop()
    counts: dict[str, int] = {}
    if a.raw:
        with open(a.raw, "w") as f:
            json.dump(results, f)
    for _, status, *_ in results:
        counts[str(status)] = counts.get(str(status), 0) + 1
    figure = {"figure": "storm", "hog": a.hog, "clients": a.clients, "seconds": a.seconds, "wall_s": round(wall, 1),
              "client_timeout_s": a.timeout, "requests": len(results),
              "ok_200": counts.pop("200", 0), "shed_429": counts.pop("429", 0),
              "deadline_504": counts.pop("504", 0), "timeouts": counts.pop("timeout", 0), "other": counts,
              "mean_batch_s": round(batch_s, 3), "after_storm_status": after}
    for kind, limit in bounds.items():
        lat = [t for k, s, t, *_ in results if k == kind and s == 200]
        server = [t for k, s, _, t, *_ in results if k == kind and s == 200 and t is not None]
        if not lat:
            continue
        p50, p99 = (float(np.percentile(lat, q)) for q in (50, 99))
        s99 = float(np.percentile(server, 99)) if server else float("nan")
        # the promise per request: its bound plus the batches it ran in, as the server timed them (`inference`
        # of server-timing; for a lone query, the one batch it ran in)
        promised = [(t, limit + b) for k, s, t, _, _, _, b in results if k == kind and s == 200 and b is not None]
        ratios = [t / promise for t, promise in promised]
        figure[kind] = {"accepted": len(lat), "p50_s": round(p50, 3), "p99_s": round(p99, 3),
                        "max_s": round(max(lat), 3), "bound_s": limit,
                        "p99_over_bound_plus_batch": round(p99 / (limit + batch_s), 3),
                        "server_p99_s": round(s99, 3),
                        "server_p99_over_bound_plus_batch": round(s99 / (limit + batch_s), 3),
                        "over_own_promise": sum(r > 1.0 for r in ratios),
                        "p99_over_own_promise": round(float(np.percentile(ratios, 99)), 3) if ratios else None,
                        "max_over_own_promise": round(max(ratios), 3) if ratios else None}
    if a.note:
        figure["note"] = a.note
    print(json.dumps(figure))
    record("storm", figure, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
