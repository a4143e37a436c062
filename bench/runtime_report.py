"""The runtime's headline figures in one run, as ratios against baselines measured in the same run.

1. the in-process ceiling (bench/ceiling.py): same model, no HTTP, sorted and packed by token budget;
2. our server under load (bench/serve_load.py): backfill embeddings/s, single-query latency;
3. optionally Infinity (`--infinity PATH_TO_infinity_emb`) serving the same model directory.

Prints one JSON line, also appended to bench/results/runtime_report-cpu.jsonl: server backfill ÷ ceiling
(goal >= 1.0) and single-query p50 at concurrency 1 minus the ceiling's single-query time (goal <= 1 ms),
plus Infinity's figures as ratios to ours.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess

import ceiling
import serve_load
from _common import add_results_dir, free_port, record, wait_ready
from embedfleet.runtime.settings import default_model_dir


def infinity_figures(binary: str, n: int, per_request: int, concurrency: int) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [binary, "v2", "--model-id", str(default_model_dir()), "--served-model-name", "all-MiniLM-L6-v2",
         "--port", str(port), "--engine", "torch", "--device", "cpu", "--batch-size", "32", "--no-bettertransformer"],
        env=dict(os.environ, HF_HUB_OFFLINE="1", INFINITY_ANONYMOUS_USAGE_STATS="0"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, path="/health")
        # Infinity serves OpenAI's route without the /v1 prefix
        return serve_load.measure(url, "all-MiniLM-L6-v2", n, per_request, concurrency, [], path="/embeddings")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--inputs-per-request", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--infinity", help="path to the infinity_emb executable (installed in its own venv)")
    add_results_dir(p, "runtime_report-cpu.jsonl")
    a = p.parse_args()
    ceil = ceiling.measure(a.n, a.dtype, 16384, 32)
    ours = serve_load.measure(None, "all-MiniLM-L6-v2", a.n, a.inputs_per_request, a.concurrency,
                              ["--dtype", a.dtype])
    out = {
        "figure": "runtime_report", "dtype": a.dtype, "inputs": a.n,
        "ceiling_embeddings_per_s": ceil["embeddings_per_s"],
        "server_embeddings_per_s": ours["backfill"]["embeddings_per_s"],
        "server_over_ceiling": round(ours["backfill"]["embeddings_per_s"] / ceil["embeddings_per_s"], 3),
        "ceiling_single_query_ms": ceil["single_query_ms"],
        "server_c1": ours["online_c1"], "server_c16": ours["online_c16"],
        "single_query_overhead_ms": round(ours["online_c1"]["p50_ms"] - ceil["single_query_ms"], 3),
    }
    if a.infinity:
        inf = infinity_figures(a.infinity, a.n, a.inputs_per_request, a.concurrency)
        out["infinity_embeddings_per_s"] = inf["backfill"]["embeddings_per_s"]
        out["server_over_infinity_throughput"] = round(
            ours["backfill"]["embeddings_per_s"] / inf["backfill"]["embeddings_per_s"], 3)
        out["infinity_c1"], out["infinity_c16"] = inf["online_c1"], inf["online_c16"]
        out["infinity_p50_c1_over_server"] = round(inf["online_c1"]["p50_ms"] / ours["online_c1"]["p50_ms"], 3)
    print(json.dumps(out))
    record("runtime_report", out, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
