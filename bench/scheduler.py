"""Global scheduler: placement time for 10,000 deployments over 100 clusters, and the replica moves a 5%
load change causes. One JSON line.

Fleet: 100 clusters in 10 regions over 3 providers, each with CPU slots and one or two GPU types
(seeded, so every run measures the same input). Deployments: a mix of region-locked (1-2 regions),
active-active (minRegions 2-3, even or weighted), active-passive, CPU and GPU, 1-40 replicas.

Figures:
  place_seconds            one place() call for the whole fleet (best of --repeat), goal < 2 s
  moves_*                  after a 5% load increase on every deployment (targets x 1.05, rounded), with the
                           previous placement fed back: ``replicas_added`` is what the load change itself
                           needs, ``replicas_moved`` counts replicas taken off one cluster of a deployment
                           and put on another (pure churn; goal 0), ``pairs_changed`` the (deployment,
                           cluster) shares that changed, ``pairs_changed_min`` the fewest that could
                           (one per added replica at most, per deployment).
  baseline_*               the same change placed *without* the previous placement (no stickiness),
                           measured in the same run, for the ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "operator"))

from embedfleet.operator.scheduling import Cluster, Deployment, GPUCapacity, Intent, Placement, place

GPU_TYPES = ("nvidia-l4", "nvidia-a100-80gb", "nvidia-h100")
PRICES = {"nvidia-l4": 0.8, "nvidia-a100-80gb": 3.0, "nvidia-h100": 4.5}


def fleet(n_clusters: int, rng: random.Random) -> list[Cluster]:
    regions = [f"region-{i}" for i in range(10)]
    out = []
    for i in range(n_clusters):
        types = rng.sample(GPU_TYPES, rng.randint(1, 2))
        gpus = tuple(GPUCapacity(t, rng.randint(256, 1024), PRICES[t] * rng.uniform(0.8, 1.2)) for t in types)
        out.append(
            Cluster(
                name=f"c{i:03d}",
                region=regions[i % len(regions)],
                provider=("aws", "gcp", "azure")[i % 3],
                residency=frozenset({"eu"} if i % 10 < 4 else {"us"}),
                gpus=gpus,
                cpu_replicas=rng.randint(2000, 6000),
                cpu_hourly_price=rng.uniform(0.05, 0.2),
            )
        )
    return out


def deployments(n: int, rng: random.Random) -> list[Deployment]:
    regions = [f"region-{i}" for i in range(10)]
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.4:
            intent = Intent(mode="RegionLocked", regions=tuple(rng.sample(regions, rng.randint(1, 2))))
        elif kind < 0.8:
            intent = Intent(mode="ActiveActive", min_regions=rng.randint(2, 3))
        else:
            primary = rng.choice(regions)
            intent = Intent(mode="ActivePassive", primary_regions=(primary,))
        gpu = rng.random() < 0.3
        target = rng.randint(1, 40)
        out.append(
            Deployment(
                key=f"ns{i % 50}/d{i:05d}",
                target=target,
                max_replicas=target * 2,
                intent=intent,
                gpu_type=rng.choice(GPU_TYPES) if gpu else None,
                gpus_per_replica=1 if gpu else 0,
            )
        )
    return out


def with_load(deps: list[Deployment], factor: float, previous: dict[str, Placement] | None) -> list[Deployment]:
    out = []
    for d in deps:
        prev = previous[d.key].desired() if previous is not None else {}
        target = max(1, round(d.target * factor))
        out.append(Deployment(d.key, target, max(d.max_replicas, target), d.intent, d.namespace_labels,
                              d.gpu_type, d.gpus_per_replica, d.digest, prev))
    return out


def moves(before: dict[str, Placement], after: dict[str, Placement]) -> dict[str, int]:
    added = moved = pairs = pairs_min = 0
    for key, b in before.items():
        old, new = b.desired(), after[key].desired()
        deltas = [new.get(c, 0) - old.get(c, 0) for c in set(old) | set(new)]
        net = sum(deltas)
        gross = sum(abs(x) for x in deltas)
        added += abs(net)
        moved += (gross - abs(net)) // 2
        pairs += sum(1 for x in deltas if x)
        pairs_min += min(abs(net), len(new)) if net else 0
    return {"replicas_added": added, "replicas_moved": moved, "pairs_changed": pairs, "pairs_changed_min": pairs_min}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=10_000)
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    clusters = fleet(args.clusters, rng)
    deps = deployments(args.deployments, rng)

    times = []
    first: dict[str, Placement] = {}
    for _ in range(args.repeat):
        start = time.perf_counter()
        first = place(deps, clusters, now=0.0)
        times.append(time.perf_counter() - start)
    settled = place(with_load(deps, 1.0, first), clusters, now=1.0)  # the steady state, sticky
    grown = place(with_load(deps, 1.05, settled), clusters, now=2.0)
    sticky = moves(settled, grown)
    fresh = moves(settled, place(with_load(deps, 1.05, None), clusters, now=2.0))
    placed = sum(p.placed for p in first.values())
    print(json.dumps({
        "bench": "scheduler",
        "deployments": args.deployments,
        "clusters": args.clusters,
        "place_seconds": round(min(times), 3),
        "goal_seconds": 2.0,
        "ratio_to_goal": round(min(times) / 2.0, 3),
        "replicas_placed": placed,
        "replicas_wanted": sum(p.target for p in first.values()),
        "moves_replicas_added": sticky["replicas_added"],
        "moves_replicas_moved": sticky["replicas_moved"],
        "moves_pairs_changed": sticky["pairs_changed"],
        "moves_pairs_changed_min": sticky["pairs_changed_min"],
        "baseline_replicas_moved": fresh["replicas_moved"],
        "baseline_pairs_changed": fresh["pairs_changed"],
        "pairs_total": sum(len(p.desired()) for p in settled.values()),
        "churn_ratio_vs_baseline": round(sticky["replicas_moved"] / fresh["replicas_moved"], 4)
        if fresh["replicas_moved"] else 0.0,
        "ceil_check": math.isfinite(min(times)),
    }))


if __name__ == "__main__":
    main()
