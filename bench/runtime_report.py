"""The runtime's headline figures in one run, as ratios against baselines measured in the same run.

1. the in-process ceiling (bench/ceiling.py): same model, no HTTP, sorted and packed by token budget;
2. our server under load (bench/serve_load.py): backfill embeddings/s, single-query latency;
3. optionally Infinity (`--infinity PATH_TO_infinity_emb`) serving the same model directory.

The ceiling runs in a process of its own and alternates with the server round by round (which goes first
alternates too), so that the host's load falls on both alike; with `--restarts N` both are started afresh
N times and every round of every pair is pooled, so that no single process' speed decides the ratio.
Each new pair first runs an unmeasured warm-up round (`--warmup` texts a side): a fresh process's first
batches run slower while its heap grows, and the round that pays for it would favour whichever side it fell on.

Prints one JSON line, also appended to bench/results/runtime_report-cpu.jsonl: server backfill ÷ ceiling
(goal >= 1.0) and single-query p50 at concurrency 1 minus the ceiling's single-query p50 (goal <= 1 ms),
pooled over every round, with each round's own figures beside them; plus Infinity's figures as ratios to
ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess

import serve_load
from _common import Server, add_results_dir, corpus, free_port, metric, percentiles, record, wait_ready
from ceiling import CeilingProcess
from embedfleet.runtime.settings import default_model_dir

MODEL = "all-MiniLM-L6-v2"


def infinity_figures(binary: str, n: int, per_request: int, concurrency: int) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [binary, "v2", "--model-id", str(default_model_dir()), "--served-model-name", MODEL,
         "--port", str(port), "--engine", "torch", "--device", "cpu", "--batch-size", "32", "--no-bettertransformer"],
        env=dict(os.environ, HF_HUB_OFFLINE="1", INFINITY_ANONYMOUS_USAGE_STATS="0"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, path="/health")
        # Infinity serves OpenAI's route without the /v1 prefix
        return serve_load.measure(url, MODEL, n, per_request, concurrency, [], path="/embeddings")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def one_round(ceiling: CeilingProcess, url: str, n: int, seed: int, per_request: int, concurrency: int,
              singles: int, server_first: bool) -> dict:
    """The ceiling and the server on the same texts, backfill then single queries, in the given order."""
    def ceiling_side() -> tuple[dict, list[float]]:
        return ceiling.backfill(n, seed), ceiling.single(singles)

    def server_side() -> tuple[dict, list[float]]:
        texts = corpus(n, seed=seed)
        busy = metric(url, ENGINE_BUSY)
        fill = asyncio.run(serve_load.backfill(url, MODEL, texts, per_request, concurrency))
        fill["engine_seconds"] = metric(url, ENGINE_BUSY) - busy
        samples, _ = asyncio.run(serve_load.online_samples(url, MODEL, 1, singles))
        return fill, samples

    if server_first:
        (s_fill, s_single), (c_fill, c_single) = server_side(), ceiling_side()
    else:
        (c_fill, c_single), (s_fill, s_single) = ceiling_side(), server_side()
    return {"ceiling_inputs": c_fill["inputs"], "ceiling_seconds": c_fill["seconds"],
            "server_inputs": s_fill["inputs"], "server_seconds": s_fill["seconds"],
            "ceiling_forward_seconds": c_fill["forward_seconds"], "server_engine_seconds": s_fill["engine_seconds"],
            "ceiling_single": c_single, "server_single": s_single, "server_first": server_first}


SIDES = ("ceiling", "server")
ENGINE_BUSY = "embedfleet_engine_busy_seconds_total"
WARMUP_SEED = 1_000_000  # the warm-up's texts are none of the rounds'


def summary(rounds: list[dict]) -> dict:
    """Pooled figures over every round (rates as total inputs ÷ total seconds, p50s over every sample),
    and each round's own ratio and overhead, so a reader sees the spread the pooled figure hides."""
    def rate(side: str, rs: list[dict]) -> float:
        return sum(r[f"{side}_inputs"] for r in rs) / sum(r[f"{side}_seconds"] for r in rs)

    def p50_ms(side: str, rs: list[dict]) -> float:
        return statistics.median(x for r in rs for x in r[f"{side}_single"]) * 1000

    ceiling, server = rate("ceiling", rounds), rate("server", rounds)
    c_p50, s_p50 = p50_ms("ceiling", rounds), p50_ms("server", rounds)
    return {
        "ceiling_embeddings_per_s": round(ceiling, 2), "server_embeddings_per_s": round(server, 2),
        "server_over_ceiling": round(server / ceiling, 3),
        "ceiling_single_query_ms": round(c_p50, 3),
        "server_c1": {"concurrency": 1, **percentiles([x for r in rounds for x in r["server_single"]])},
        "single_query_overhead_ms": round(s_p50 - c_p50, 3),
        "round_server_over_ceiling": [round(rate("server", [r]) / rate("ceiling", [r]), 3) for r in rounds],
        "round_single_query_overhead_ms": [round(p50_ms("server", [r]) - p50_ms("ceiling", [r]), 3)
                                           for r in rounds],
        # the model's own time on the same texts: the server's engine (embedfleet_engine_busy_seconds_total)
        # against the ceiling's forward passes. The server's host path (HTTP, tokenizer, the load generator)
        # runs beside its engine on the same cores, so its cost shows in both: the engine's share of the wall
        # time (the rest: the engine idle), and the engine's time over the ceiling's on the same texts
        "server_engine_over_ceiling_forward": round(sum(r["server_engine_seconds"] for r in rounds)
                                                    / sum(r["ceiling_forward_seconds"] for r in rounds), 3),
        "server_engine_share": round(sum(r["server_engine_seconds"] for r in rounds)
                                     / sum(r["server_seconds"] for r in rounds), 3),
        # each side's own figures by round: which side moves when the order changes
        "round_embeddings_per_s": {side: [round(rate(side, [r]), 2) for r in rounds] for side in SIDES},
        "round_single_query_ms": {side: [round(p50_ms(side, [r]), 3) for r in rounds] for side in SIDES},
        "round_server_first": [r["server_first"] for r in rounds],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=5_000, help="texts per round (natural order, a new seed each round)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--inputs-per-request", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per pair of processes")
    p.add_argument("--restarts", type=int, default=2, help="pairs of processes (ceiling, server), one after another")
    p.add_argument("--singles", type=int, default=150, help="single queries per side per round")
    p.add_argument("--warmup", type=int, default=1_000,
                   help="texts each side of a new pair runs, unmeasured, before its rounds (0: none)")
    p.add_argument("--infinity", help="path to the infinity_emb executable (installed in its own venv)")
    add_results_dir(p, "runtime_report-cpu.jsonl")
    a = p.parse_args()
    rounds: list[dict] = []
    c16: list[float] = []
    for restart in range(a.restarts):
        with CeilingProcess(a.dtype) as ceiling:
            server = Server("--dtype", a.dtype)
            try:
                if a.warmup:  # a fresh process's first batches of each size run slower (its heap grows, caches fill)
                    first_round_server_first = (restart * a.rounds) % 2 == 1  # as `k` below gives it
                    one_round(ceiling, server.url, a.warmup, WARMUP_SEED + restart, a.inputs_per_request,
                              a.concurrency, 20, server_first=not first_round_server_first)
                for i in range(a.rounds):
                    k = restart * a.rounds + i
                    rounds.append(one_round(ceiling, server.url, a.n, k, a.inputs_per_request, a.concurrency,
                                            a.singles, server_first=k % 2 == 1))
                c16 += asyncio.run(serve_load.online_samples(server.url, MODEL, 16, 600))[0]
            finally:
                server.stop()
    out = {"figure": "runtime_report", "dtype": a.dtype, "inputs": a.n * len(rounds),
           "inputs_per_request": a.inputs_per_request, "concurrency": a.concurrency,
           "rounds": a.rounds, "restarts": a.restarts, **summary(rounds),
           "server_c16": {"concurrency": 16, **percentiles(c16)}}
    if a.infinity:
        inf = infinity_figures(a.infinity, a.n, a.inputs_per_request, a.concurrency)
        out["infinity_embeddings_per_s"] = inf["backfill"]["embeddings_per_s"]
        out["server_over_infinity_throughput"] = round(
            out["server_embeddings_per_s"] / inf["backfill"]["embeddings_per_s"], 3)
        out["infinity_c1"], out["infinity_c16"] = inf["online_c1"], inf["online_c16"]
        out["infinity_p50_c1_over_server"] = round(inf["online_c1"]["p50_ms"] / out["server_c1"]["p50_ms"], 3)
    print(json.dumps(out))
    record("runtime_report", out, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
