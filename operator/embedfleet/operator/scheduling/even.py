"""The common case in a few array operations: an even split that nothing but free capacity caps.

When no candidate of a deployment has a cap other than its free capacity (`Group.plain`: no cluster
limits, NoSchedule taints, return ramps, floors, weights, choice of GPU type or ``maxClusters`` cut) and
the total is Divided, the full pipeline (pipeline.py) selects every candidate (ActivePassive: every primary
one with room), and if each has room for its even share it splits the total evenly in division order,
spills nothing and has nothing to repair unless the placed clusters miss ``minRegions``. `decide_even`
produces that result without scoring or ordering the candidates, and returns None, having changed nothing,
whenever a condition does not hold: the pipeline then decides.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from itertools import repeat

import numpy as np

from embedfleet.operator.scheduling.inventory import Group, Inventory
from embedfleet.operator.scheduling.model import ClusterPlacement, Deployment
from embedfleet.operator.scheduling.pipeline import Decision, left_out
from embedfleet.operator.scheduling.shares import Ledger, Shares


def decide_even(d: Deployment, g: Group, inventory: Inventory, ledger: Ledger) -> Decision | None:
    """`pipeline.decide` for a deployment of a plain group, or None when the shortcut does not apply."""
    rules = g.rules
    per_replica = max(1, d.gpus_per_replica)
    target = d.target
    if rules.mode == "ActivePassive":  # selected: the primary candidates with room for one replica
        selected, twice = g.primary_at, g.primary_twice
        free = inventory.free[g.primary_flat]
        if len(free) and int(free.min()) < per_replica:
            room = free >= per_replica
            selected, twice, free = selected[room], None, free[room]
        why = "primary region"
    else:
        selected, twice = g.twice[: len(g)], g.twice
        free = inventory.free[g.flat]
        why = "spread"
        if rules.mode == "ActiveActive":
            target = max(target, min(rules.min_regions, d.max_replicas))
    n = len(selected)
    if not n:
        return None
    turn = zlib.crc32(d.key.encode()) % n
    order = twice[turn : turn + n] if twice is not None else np.concatenate((selected[turn:], selected[:turn]))
    lowest = int(free.min())
    fresh = lowest >= per_replica
    if not fresh:
        # Water-filling leaves out a selected candidate without room for one replica; the others split the
        # total evenly if each has room for more than the even share. With a previous division, the
        # incremental rule may keep it instead: left to the pipeline.
        if d.previous:
            return None
        room = free >= per_replica
        order = order[room[order]]
        if not len(order):
            return None
        lowest = int(free[room].min())
    m = len(order)
    base, rest = divmod(target, m)
    if lowest < (base + (1 if rest or not fresh else 0)) * per_replica:
        return None  # a cap binds: water-filling
    previous = g.previous(d.previous) if d.previous else None
    top: np.ndarray | slice = slice(0, rest)  # which get one more: the first in division order...
    if rest and previous is not None:  # ... or the larger previous, then the first
        top = np.sort(np.argsort(-previous[order], kind="stable")[:rest])
    if base:
        placed = order
        replicas = np.full(m, base, dtype=np.int64)
        replicas[top] += 1
    else:
        placed = order[top]
        replicas = g.unit[: len(placed)]
    if rules.mode == "ActiveActive" and rules.min_regions > 1 and not _covers(g, placed, rules.min_regions):
        return None  # the minRegions repair moves replicas

    flat = g.flat[placed]
    had = inventory.free[flat]
    inventory.free[flat] -= replicas * per_replica if per_replica > 1 else replicas
    clusters: dict[str, ClusterPlacement] = {}
    shares = Shares(clusters, g, repeat(why, len(placed)), repeat(f"1/{float(n):g}", len(placed)), None,
                    d.max_replicas, target, True, per_replica)
    ledger.add(shares, d, placed, replicas, had, previous)

    # Left out: candidates not selected, and selected ones that ran it before and get nothing now.
    holders: list[int] = []
    if previous is not None and not base:  # (with a base, every selected candidate gets replicas)
        given = set(placed.tolist())
        holders = [p for p in np.flatnonzero(previous > 0).tolist() if p not in given]
    if rules.mode == "ActivePassive" and twice is None:  # some primary candidate is full
        in_selection = np.zeros(len(g), dtype=bool)
        in_selection[selected] = True
        filtered = left_out(g, np.flatnonzero(~in_selection).tolist(), holders, why)
        return Decision(clusters, filtered, target, [], base * m + rest)
    shared: Mapping[str, str] = g.rejected
    if rules.mode == "ActivePassive":  # every non-primary candidate, the same for the whole group
        shared = g.left_out.get(why) or g.left_out.setdefault(
            why, left_out(g, np.flatnonzero(~g.primary).tolist(), (), why))
    if holders:
        shared = {**shared, **{g.names[p]: f"not selected ({why})" for p in holders}}
    return Decision(clusters, shared, target, [], base * m + rest)


def _covers(g: Group, placed: np.ndarray, regions: int) -> bool:
    """Do the placed candidates span at least ``regions`` regions? (Usually the first few tell.)"""
    seen: set[int] = set()
    for p in placed.tolist():
        seen.add(g.region_ids[p])
        if len(seen) >= regions:
            return True
    return False
