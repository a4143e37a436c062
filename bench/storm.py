"""Overload storm: many clients, mixed requests, against a default `embedfleet serve`.

256 closed-loop clients for 20 s, each sending one request at a time: a lone query (60%), two to four
passages (25%, still urgent: --urgent-max-inputs is 4) or a bulk batch of 32 passages (15%, bounded by
--max-queue-seconds-bulk). A 429 is honoured as the OpenAI SDK does (sleep Retry-After, then go on);
a client gives up after 60 s. Before admission by expected wait, this storm got no 429s, 191 client
time-outs and a p99 of 59 s.

Prints one JSON line: counts of 200/429/504/time-outs/other, accepted p50/p99 per kind, the mean
engine batch time from /metrics, and p99 / (bound + one batch) per kind (1.0 is the admission
promise met exactly; it is a behaviour figure, not a speed figure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from _common import Server, corpus


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def pick(rng: random.Random, texts: list[str]) -> tuple[str, list[str]]:
    r = rng.random()
    if r < 0.6:
        return "query", [rng.choice(texts)]
    if r < 0.85:
        return "query", rng.sample(texts, rng.randint(2, 4))
    return "bulk", rng.sample(texts, 32)


async def client(i: int, url: str, texts: list[str], until: float, client_timeout: float, out: list) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=url, timeout=client_timeout) as http:
        while time.monotonic() < until:
            kind, inputs = pick(rng, texts)
            started = time.monotonic()
            try:
                resp = await http.post("/v1/embeddings", json={"input": inputs})
            except httpx.TimeoutException:
                out.append((kind, "timeout", time.monotonic() - started))
                continue
            except httpx.TransportError as exc:
                out.append((kind, f"error:{type(exc).__name__}", time.monotonic() - started))
                continue
            out.append((kind, resp.status_code, time.monotonic() - started))
            if resp.status_code == 429:
                wait = float(resp.headers.get("retry-after", "1"))
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
    a = p.parse_args()
    from embedfleet.runtime.settings import RuntimeSettings

    defaults = RuntimeSettings()
    bounds = {"query": defaults.max_queue_seconds, "bulk": defaults.max_queue_seconds_bulk}
    srv = Server()
    try:
        started = time.monotonic()
        results = asyncio.run(storm(srv.url, a.clients, a.seconds, a.timeout))
        wall = time.monotonic() - started
        batches = metric(srv.url, "embedfleet_batch_size_count")
        batch_s = metric(srv.url, "embedfleet_engine_busy_seconds_total") / max(batches, 1)
        after = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "after the storm"}, timeout=60).status_code
    finally:
        srv.stop()
    counts: dict[str, int] = {}
    for _, status, _ in results:
        counts[str(status)] = counts.get(str(status), 0) + 1
    figure = {"figure": "storm", "clients": a.clients, "seconds": a.seconds, "wall_s": round(wall, 1),
              "client_timeout_s": a.timeout, "requests": len(results),
              "ok_200": counts.pop("200", 0), "shed_429": counts.pop("429", 0),
              "deadline_504": counts.pop("504", 0), "timeouts": counts.pop("timeout", 0), "other": counts,
              "mean_batch_s": round(batch_s, 3), "after_storm_status": after}
    for kind, limit in bounds.items():
        lat = [t for k, s, t in results if k == kind and s == 200]
        if not lat:
            continue
        p50, p99 = (float(np.percentile(lat, q)) for q in (50, 99))
        figure[kind] = {"accepted": len(lat), "p50_s": round(p50, 3), "p99_s": round(p99, 3),
                        "max_s": round(max(lat), 3), "bound_s": limit,
                        "p99_over_bound_plus_batch": round(p99 / (limit + batch_s), 3)}
    print(json.dumps(figure))


if __name__ == "__main__":
    main()
