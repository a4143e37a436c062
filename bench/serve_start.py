"""Process start to ready, for `embedfleet serve` on the embedded model: the native BERT modules against
transformers' (`--model-impl transformers`), in one run.

Each round starts the server twice, once each way, in alternating order (so neither always runs second on a
warm page cache). A poller asks `/ready` every 10 ms; "ready" is its first 200, "first answer" the first
`/v1/embeddings` 200 after it. The server's CPU seconds (all threads) are read from /proc at ready, and its
own cold-start phases (`embedfleet_cold_start_seconds{phase}`: engine_load, warmup) from /metrics.

Prints one JSON line, also appended to bench/results/serve-start-cpu.jsonl: per way the medians over the
rounds, and native ÷ transformers for ready seconds and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx

from _common import ROOT, SOURCE_PATHS, add_results_dir, free_port, record, thread_cpu_seconds, wait_ready

WAYS = {"native": "auto", "transformers": "transformers"}


def phases(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^embedfleet_cold_start_seconds_sum\{phase="(\w+)"\} (\S+)$', text, re.M)}


def one_start(impl: str) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS), HF_HUB_OFFLINE="1")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning", "--model-impl", impl],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc, timeout=300, interval=0.01)
        ready = time.monotonic() - started
        cpu = sum(thread_cpu_seconds(proc.pid))
        with httpx.Client(timeout=5) as client:
            client.post(f"{url}/v1/embeddings", json={"input": "first"}).raise_for_status()
            answered = time.monotonic() - started
        found = phases(url)
        return {"ready_s": ready, "first_answer_s": answered, "cpu_at_ready_s": cpu,
                "engine_load_s": found.get("engine_load", 0.0), "warmup_s": found.get("warmup", 0.0)}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    add_results_dir(parser, "serve-start-cpu.jsonl")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
        for way in order:
            runs[way].append(one_start(WAYS[way]))
    row: dict = {"bench": "serve_start", "rounds": args.rounds}
    for way, samples in runs.items():
        row[way] = {key: round(statistics.median(s[key] for s in samples), 3) for key in samples[0]}
        row[way]["ready_s_all"] = [round(s["ready_s"], 3) for s in samples]
    for key in ("ready_s", "cpu_at_ready_s"):
        row[f"native_over_transformers_{key}"] = round(row["native"][key] / row["transformers"][key], 3)
    record("serve-start", row, results_dir=args.results_dir)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
