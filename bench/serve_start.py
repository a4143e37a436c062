"""Process start to ready, for `embedfleet serve` on the embedded model: the native BERT modules against
transformers' (`--model-impl transformers`), in one run.

Each round starts the server twice, once each way, in alternating order (so neither always runs second on a
warm page cache). A poller asks `/ready` every 10 ms; "ready" is its first 200, "first answer" the first
`/v1/embeddings` 200 after it. The server's CPU seconds (all threads) are read from /proc at ready, and its
own cold-start phases (`embedfleet_cold_start_seconds{phase}`: engine_load, warmup) from /metrics.

Prints one JSON line, also appended to bench/results/serve-start-cpu.jsonl: per way the medians over the
rounds, and native ÷ transformers for ready seconds and CPU seconds.

`--baseline-tree DIR` (a checkout of another commit: `git worktree add DIR <commit>`) compares that tree's
`embedfleet serve` with this tree's instead, both the default way, in the same alternating rounds: the
row then holds `baseline` and `this_tree` and this tree ÷ the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from _common import (
    ROOT,
    add_results_dir,
    baseline_checkout,
    free_port,
    record,
    source_paths,
    stop_process,
    thread_cpu_seconds,
    wait_ready,
)

WAYS = {"native": "auto", "transformers": "transformers"}


def phases(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^embedfleet_cold_start_seconds_sum\{phase="(\w+)"\} (\S+)$', text, re.M)}


def one_start(impl: str, tree: Path = ROOT) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(source_paths(tree)), HF_HUB_OFFLINE="1")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning", "--model-impl", impl],
                            env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        stop_process(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-tree", type=Path, help="compare this checkout's serve with this tree's")
    parser.add_argument("--note", help="a note added to the row (e.g. what else ran on the machine)")
    add_results_dir(parser, "serve-start-cpu.jsonl")
    args = parser.parse_args()
    if args.baseline_tree is not None:
        sides = {"baseline": ("auto", baseline_checkout(args.baseline_tree).resolve()), "this_tree": ("auto", ROOT)}
    else:
        sides = {way: (impl, ROOT) for way, impl in WAYS.items()}
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            runs[side].append(one_start(*sides[side]))
    row: dict = {"bench": "serve_start", "rounds": args.rounds, **({"note": args.note} if args.note else {})}
    for side, samples in runs.items():
        row[side] = {key: round(statistics.median(s[key] for s in samples), 3) for key in samples[0]}
        row[side]["ready_s_all"] = [round(s["ready_s"], 3) for s in samples]
    top, bottom = ("this_tree", "baseline") if args.baseline_tree is not None else ("native", "transformers")
    for key in ("ready_s", "first_answer_s", "cpu_at_ready_s"):
        row[f"{top}_over_{bottom}_{key}"] = round(row[top][key] / row[bottom][key], 3)
    if args.baseline_tree is not None:
        row["baseline_commit"] = subprocess.run(["git", "-C", str(args.baseline_tree), "rev-parse", "--short=12",
                                                 "HEAD"], capture_output=True, text=True).stdout.strip()
    record("serve-start", row, results_dir=args.results_dir)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
