"""Cost-aware placement: time of one ``place()`` call for 10,000 deployments over 100 clusters ranked by cost
per million embeddings, against the same call ranked by hourly price alone (``throughput=None``) on the same
input in the same run, alternating the two so both see the same machine load. One JSON line, also appended to
bench/results/placement-cost-cpu.jsonl.

Input: bench/scheduler.py's seeded fleet and deployments, each deployment given one of six models (22M to
8B parameters, so the priors differ), and a measured throughput table with an entry for half of the
(model, resource) pairs (so costs mix measured figures and priors, as in a fleet that has run a while). Every
fifth deployment takes any GPU type (a GPU one) and, when active-active, has ``maxClusters: 3``: there the
ranking picks clusters (among candidates of one resource type, cost orders them as the hourly price does).

Figures:
  place_s_cost, place_s_price    best of --repeat calls each (wall clock; the machine is shared, so the best
                                 run is the least disturbed one); goal 0.5 s for the cost ranking
  ratio_cost_vs_price            place_s_cost / place_s_price
  decisions_changed              deployments whose (cluster -> desired) differ between the two rankings
  measured_pairs, prior_pairs    placed (deployment, cluster) pairs whose cost was measured / a prior

Run: .venv/bin/python bench/placement_cost.py (about 20 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

from _common import add_results_dir, record  # noqa: E402
from embedfleet.operator.scheduling import Placement, place  # noqa: E402
from embedfleet.operator.scheduling.cost import Throughput  # noqa: E402
from embedfleet.operator.scheduling.model import CPU  # noqa: E402
from scheduler import GPU_TYPES, deployments, fleet  # noqa: E402

MODELS = ("hf://sentence-transformers/all-MiniLM-L6-v2", "hf://BAAI/bge-small-en-v1.5", "hf://BAAI/bge-base-en-v1.5",
          "hf://BAAI/bge-large-en-v1.5", "hf://Qwen/Qwen3-Embedding-0.6B", "hf://Qwen/Qwen3-Embedding-8B")
GOAL_S = 0.5


def timed(deps: list[Any], clusters: list[Any], throughput: Throughput | None) -> tuple[float, dict[str, Placement]]:
    gc.collect()
    started = time.perf_counter()
    result = place(deps, clusters, now=0.0, throughput=throughput)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=6, help="place() calls per ranking")
    parser.add_argument("--seed", type=int, default=0)
    add_results_dir(parser, "placement-cost-cpu.jsonl")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    clusters = fleet(100, rng)
    deps = [dataclasses.replace(d, model=rng.choice(MODELS)) for d in deployments(10_000, rng)]
    # Every fifth deployment takes any GPU type, and if active-active keeps its best 3 clusters (maxClusters):
    # there the ranking decides (with one resource type, cost orders candidates as the hourly price does).
    deps = [dataclasses.replace(d, gpu_type=None, intent=dataclasses.replace(
        d.intent, max_clusters=3 if d.intent.mode == "ActiveActive" else None)) if i % 5 == 0 else d
        for i, d in enumerate(deps)]
    measured = {(m, r): rng.uniform(5, 3000) for m in MODELS for r in (CPU, *GPU_TYPES) if rng.random() < 0.5}
    throughput = Throughput(measured)
    cost_times, price_times = [], []
    cost_result: dict[str, Placement] = {}
    price_result: dict[str, Placement] = {}
    for _ in range(args.repeat):
        seconds, cost_result = timed(deps, clusters, throughput)
        cost_times.append(seconds)
        seconds, price_result = timed(deps, clusters, None)
        price_times.append(seconds)
    pairs = [c for p in cost_result.values() for c in p.clusters.values()]
    out = {
        "bench": "placement_cost",
        "deployments": len(deps),
        "clusters": len(clusters),
        "goal_s": GOAL_S,
        "place_s_cost": round(min(cost_times), 3),
        "place_s_price": round(min(price_times), 3),
        "ratio_cost_vs_price": round(min(cost_times) / min(price_times), 3),
        "decisions_changed": sum(cost_result[k].desired() != price_result[k].desired() for k in cost_result),
        "measured_pairs": sum(c.measured for c in pairs),
        "prior_pairs": sum(not c.measured for c in pairs),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores",
    }
    line = json.dumps(out)
    print(line)
    record("placement-cost", out, results_dir=args.results_dir)



if __name__ == "__main__":
    main()
