"""The engine process' host path per input: CPU microseconds the engine side of split serving spends on each
input it serves, outside the model, this tree against a baseline checkout, measured in the same run. One JSON
line, also appended to bench/results/engine-path-cpu.jsonl.

Why this figure: with `--fronts`, HTTP, JSON and the tokenizer run in front processes, one per core, and the
engine process is left with one event loop that reads every request's ids off the link, queues them, plans
the batches, hands them to the engine thread, and writes every answer back. That loop is serial: on a GPU
(MiniLM at about 95,000 embeddings/s on an H200) its cost per input is the ceiling of the whole server, 1e6 /
(microseconds per input) embeddings/s on one core, however many fronts there are.

What runs, in one process per side (the tree's own code, no HTTP): --requests SUBMIT frames of --per-request
inputs each (lengths drawn as bench/_common.corpus()'s tokenized texts are: short queries and long passages,
seeded), built by the front side's encoder beforehand and not counted; then, timed with the process' CPU
clock (every thread: the event loop and the engine thread), each frame is read (`link.read_submit`), turned
into engine inputs (`inputs_of`), submitted to a `BatchManager` over a null engine (ones of width 384, at
once), awaited, and its answer encoded (`link.result`), --concurrency requests in flight at a time. The best
of --rounds rounds, for the padded planner and the packed one (`packed`: CUDA's BERT-family engines).

Figures: `us_per_input` per side and planner, `ceiling_per_s` (1e6 / us_per_input), and this tree over the
baseline. Without --baseline-tree (a GPU machine's copy of the tree has no history), this tree's alone.

Run: git worktree add /tmp/engine-path-base <commit>; .venv/bin/python bench/engine_path.py --baseline-tree
/tmp/engine-path-base (about 20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _common import ROOT, add_results_dir, baseline_checkout, commit_of, record, run_meta, source_paths

CHILD = r"""
import asyncio, json, random, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.split import link
from embedfleet.runtime.split.engine_side import inputs_of

requests, per_request, concurrency, rounds, packed = json.loads(sys.argv[1])
rng = random.Random(0)
def length():  # corpus(): a short query (about 10 tokens) or a passage (about 30 to 300)
    return rng.randint(6, 14) if rng.random() < 0.5 else rng.randint(30, 300)
frames = []
for r in range(requests):
    ids = [[101] + [rng.randint(1000, 29000) for _ in range(length() - 2)] + [102] for _ in range(per_request)]
    frames.append(link.submit(r, {"model": "m", "urgent": False}, ids, None, [len(x) for x in ids])[link.HEADER.size:])
WIDTH = 384
def null(batch):
    return np.ones((len(batch), WIDTH), np.float32)

async def one(bm, body):
    sub = link.read_submit(body)
    job = bm.submit(inputs_of(sub), urgent=False)
    rows = await job.future
    return link.result(sub.request_id, np.asarray(rows, dtype=np.float32), 0.0, 0.0)

async def main():
    best = float("inf")
    with ThreadPoolExecutor(1) as pool:
        bm = BatchManager(null, 65536, 1024, 10**9, RuntimeMetrics().for_model("m"), pool, packed=packed)
        bm.start()
        for _ in range(rounds + 1):  # the first round warms up
            started = time.process_time()
            for at in range(0, requests, concurrency):
                await asyncio.gather(*(one(bm, f) for f in frames[at:at + concurrency]))
            best = min(best, time.process_time() - started)
        await bm.stop()
    print(json.dumps(best / (requests * per_request) * 1e6))

asyncio.run(main())
"""


def measure(tree: Path, requests: int, per_request: int, concurrency: int, rounds: int, packed: bool) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(source_paths(tree)), HF_HUB_OFFLINE="1")
    spec = json.dumps([requests, per_request, concurrency, rounds, packed])
    out = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, cwd=tree, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-tree", type=Path,
                    help="a checkout of the baseline commit (without one: this tree's figures alone)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--per-request", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--alternations", type=int, default=3, help="runs of each side, alternating; the best is kept")
    add_results_dir(ap, "engine-path-cpu.jsonl")
    args = ap.parse_args()
    trees = {"this_tree": ROOT} if args.baseline_tree is None else {
        "baseline": baseline_checkout(args.baseline_tree), "this_tree": ROOT}
    meta = run_meta()
    figures: dict[str, dict] = {}
    for planner, packed in (("padded", False), ("packed", True)):
        sides: dict[str, list[float]] = {side: [] for side in trees}
        for _ in range(args.alternations):
            for side, tree in trees.items():
                sides[side].append(measure(tree, args.requests, args.per_request, args.concurrency, args.rounds,
                                           packed))
        best = {side: min(values) for side, values in sides.items()}
        figures[planner] = {
            **{side: {"us_per_input": round(best[side], 3), "ceiling_per_s": round(1e6 / best[side]),
                      "runs": [round(v, 3) for v in sides[side]]} for side in sides}}
        if "baseline" in best:
            figures[planner]["this_tree_over_baseline"] = round(best["this_tree"] / best["baseline"], 3)
    baseline = {} if args.baseline_tree is None else {"baseline_commit": commit_of(args.baseline_tree)}
    row = {"bench": "engine_path", **baseline, **figures,
           "requests": args.requests, "per_request": args.per_request, "concurrency": args.concurrency,
           "rounds": args.rounds, "width": 384}
    print(json.dumps(row))
    record("engine-path", row, results_dir=args.results_dir, meta=meta)


if __name__ == "__main__":
    main()
