"""The gateway's upstream client, measured: the same gateway with its work sent through its own lean
HTTP/1.1 client (gateway/wire.py) and through aiohttp's client, against one runtime, in one run.

Two gateways in front of one `embedfleet serve`, started as users start them, differing only in the
client (`EMBEDFLEET_GATEWAY_UPSTREAM_CLIENT=wire|aiohttp`, a benchmark switch of `embedfleet gateway`).
The measurement decided the gateway's one upstream client (docs/gateway.md), and the aiohttp path and
the switch went: run this from the commit that has both, ec0207e
(`git worktree add /tmp/both ec0207e`, then `python /tmp/both/bench/gateway_upstream.py`); on a later
tree both gateways run wire.py. Every figure takes turns between the variants, so a neighbour's load on
a small machine shifts them alike:

- added latency at concurrency 1: one short query at a time on one keep-alive connection per side,
  direct, via `wire` and via `aiohttp` in rotating order query by query; the median of the paired
  differences (via minus direct), and the gateway process's CPU time per query;
- backfill: `--backfill-concurrency` closed-loop clients sending bulk requests of `--backfill-inputs`
  short passages (answers of about 400 KB, streamed on), rounds alternating the variants: passages per second, and the
  gateway's CPU time per request.

Prints one JSON line per variant (`wire`, `aiohttp`), each with its ratios against `aiohttp` measured in
the same run (`added_ms_ratio` < 1: the variant adds less than aiohttp's client does); both are appended to
bench/results/gateway-upstream-cpu.jsonl with one run_meta (the run's date tells them from other runs').

    python bench/gateway_upstream.py [--pairs 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import statistics
import sys
import time

from _common import Server, add_results_dir, corpus, record, run_meta
from embedfleet.runtime.settings import DEFAULT_MODEL_NAME
from gateway import QUERY, Gateway, cpu_name, throughput

VARIANTS = ("wire", "aiohttp")
SWITCH = "EMBEDFLEET_GATEWAY_UPSTREAM_CLIENT"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@contextlib.contextmanager
def switched(client: str):
    old = os.environ.get(SWITCH)
    os.environ[SWITCH] = client
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = old


def latency(direct_port: int, gateways: dict[str, Gateway], pairs: int, warmup: int = 50) -> dict[str, dict]:
    body = json.dumps({"model": DEFAULT_MODEL_NAME, "input": QUERY}).encode()
    headers = {"content-type": "application/json"}
    conns = {"direct": http.client.HTTPConnection("127.0.0.1", direct_port)}
    conns |= {v: http.client.HTTPConnection("127.0.0.1", g.port) for v, g in gateways.items()}
    sides = list(conns)

    def one(conn: http.client.HTTPConnection) -> float:
        started = time.perf_counter()
        conn.request("POST", "/v1/embeddings", body, headers)
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data
        return time.perf_counter() - started

    for _ in range(warmup):
        for side in sides:
            one(conns[side])
    took: dict[str, list[float]] = {side: [] for side in sides}
    cpu0 = {v: cpu_s(g.proc.pid) for v, g in gateways.items()}
    for i in range(pairs):
        order = sides[i % len(sides):] + sides[:i % len(sides)]  # each side first in turn
        for side in order:
            took[side].append(one(conns[side]))
    cpu = {v: cpu_s(g.proc.pid) - cpu0[v] for v, g in gateways.items()}
    for conn in conns.values():
        conn.close()
    return {v: {"added_p50_ms": round(statistics.median(g - d for g, d in zip(took[v], took["direct"],
                                                                            strict=True)) * 1000, 3),
                "p50_ms": round(statistics.median(took[v]) * 1000, 3),
                "direct_p50_ms": round(statistics.median(took["direct"]) * 1000, 3),
                "gateway_cpu_ms_per_query": round(cpu[v] / pairs * 1000, 3)} for v in gateways}


def measure(pairs: int, rounds: int, backfill_concurrency: int, backfill_requests: int, backfill_inputs: int) -> list:
    # short passages: many vectors (a long answer, streamed on) for little engine time, so the gateway's
    # share of the work shows
    passages = [t for t in corpus(20000) if len(t.split()) <= 12]
    large = [json.dumps({"model": DEFAULT_MODEL_NAME, "input": passages[i * backfill_inputs:(i + 1) * backfill_inputs]
                         }).encode() for i in range(backfill_requests)]
    # no shedding on either side: a 429's Retry-After wait would measure the bound, not the client
    server = Server("--max-queue-seconds-bulk", "3600")
    gateways: dict[str, Gateway] = {}
    try:
        for variant in VARIANTS:
            with switched(variant):
                gateways[variant] = Gateway(server.url, "--max-queue-seconds-bulk", "0")
        lat: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        rate: dict[str, list[float]] = {v: [] for v in ("direct", *VARIANTS)}
        cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
        shed = dict.fromkeys(("direct", *VARIANTS), 0)
        urls = {"direct": server.url} | {v: g.url for v, g in gateways.items()}
        for side in urls:  # warm every path once
            asyncio.run(throughput(urls[side], large[:backfill_concurrency], backfill_concurrency))
        for i in range(rounds):
            print(f"round {i + 1}/{rounds}", file=sys.stderr, flush=True)
            for v, figures in latency(server.port, gateways, max(1, pairs // rounds)).items():
                lat[v].append(figures)
            sides = list(urls)
            order = sides[i % len(sides):] + sides[:i % len(sides)]
            for side in order:
                before = cpu_s(gateways[side].proc.pid) if side in gateways else 0.0
                per_s, refused = asyncio.run(throughput(urls[side], large, backfill_concurrency))
                rate[side].append(per_s * backfill_inputs)
                shed[side] += refused
                if side in gateways:
                    cpu[side].append((cpu_s(gateways[side].proc.pid) - before) / len(large) * 1000)
    finally:
        for g in gateways.values():
            g.stop()
        server.stop()

    def med(rows: list[dict], key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 3)

    out = {}
    for v in VARIANTS:
        out[v] = {"added_p50_ms": med(lat[v], "added_p50_ms"), "added_p50_ms_by_round": [r["added_p50_ms"]
                                                                                          for r in lat[v]],
                  "p50_ms": med(lat[v], "p50_ms"), "direct_p50_ms": med(lat[v], "direct_p50_ms"),
                  "gateway_cpu_ms_per_query": med(lat[v], "gateway_cpu_ms_per_query"),
                  "backfill_passages_per_s": round(statistics.median(rate[v]), 1),
                  "backfill_ratio_to_direct": round(statistics.median(rate[v]) / statistics.median(rate["direct"]), 3),
                  "backfill_gateway_cpu_ms_per_request": round(statistics.median(cpu[v]), 3),
                  "gateway_429": shed[v]}
    base = out["aiohttp"]
    lines = []
    for v in VARIANTS:
        row = out[v]
        lines.append({
            "figure": "gateway_upstream", "variant": v, **row,
            "added_ms_ratio": round(row["added_p50_ms"] / base["added_p50_ms"], 3) if base["added_p50_ms"] else None,
            "query_cpu_ratio": round(row["gateway_cpu_ms_per_query"] / base["gateway_cpu_ms_per_query"], 3),
            "backfill_ratio": round(row["backfill_passages_per_s"] / base["backfill_passages_per_s"], 3),
            "backfill_cpu_ratio": round(row["backfill_gateway_cpu_ms_per_request"]
                                        / base["backfill_gateway_cpu_ms_per_request"], 3),
            "direct_backfill_passages_per_s": round(statistics.median(rate["direct"]), 1), "direct_429": shed["direct"],
            "pairs": pairs, "rounds": rounds, "backfill_concurrency": backfill_concurrency,
            "backfill_requests_per_round": len(large), "backfill_inputs_per_request": backfill_inputs,
            "model": DEFAULT_MODEL_NAME, "cpus": len(os.sched_getaffinity(0)), "cpu": cpu_name()})
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=1500, help="queries per side for the c=1 figure, over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="alternate the variants this many times")
    p.add_argument("--backfill-concurrency", type=int, default=8, help="closed-loop clients sending bulk requests")
    p.add_argument("--backfill-requests", type=int, default=24, help="bulk requests per side per round")
    p.add_argument("--backfill-inputs", type=int, default=48, help="passages per bulk request")
    add_results_dir(p, "gateway-upstream-cpu.jsonl")
    a = p.parse_args()
    rows = measure(a.pairs, a.rounds, a.backfill_concurrency, a.backfill_requests, a.backfill_inputs)
    meta = run_meta()  # one for the run: its rows share the date
    for row in rows:
        print(json.dumps(row))
        record("gateway-upstream", row, results_dir=a.results_dir, meta=meta)


if __name__ == "__main__":
    main()
