"""One deployment's placement, every step (place.py's docstring, steps 3 to 8), over its candidates' arrays.

A candidate is a position in the deployment's `inventory.Group` (cluster-name order); caps, scores, the
selection and the division are arrays over those positions, so a step costs a few numpy operations whatever
the number of clusters. Python loops remain where the rules are sequential by nature: spill (what the caps
left over, holders first, then by score) and the ``minRegions`` repair (one replica at a time). The common
case takes a shortcut (even.py) to the same result.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from embedfleet.operator.scheduling.divide import divide_arrays, duplicate
from embedfleet.operator.scheduling.inventory import Group, Inventory
from embedfleet.operator.scheduling.model import ClusterPlacement, Deployment
from embedfleet.operator.scheduling.policy import Rules
from embedfleet.operator.scheduling.scores import Candidates, total
from embedfleet.operator.scheduling.shares import Ledger, Shares

#: Why a candidate that gets nothing is left out.
ZERO_WEIGHT = "weight 0 (not in spec.placement.weights)"


class Decision(NamedTuple):
    """One deployment's placement; ``clusters`` is filled in by `Ledger.finish`."""

    clusters: dict[str, ClusterPlacement]
    filtered: Mapping[str, str]
    target: int
    problems: list[str]
    placed: int


def by_score(scores: np.ndarray) -> list[int]:
    """Candidate positions, best score first; equal scores by cluster name (positions follow names)."""
    return np.argsort(-scores, kind="stable").tolist()


def left_out(g: Group, not_selected: Iterable[int], holders: Iterable[int], why: str) -> dict[str, str]:
    """``filtered``: the filter verdicts, then why each candidate without a share has none."""
    out = dict(g.rejected)
    reason = f"not selected ({why})"
    for p in (*not_selected, *holders):
        out[g.names[p]] = ZERO_WEIGHT if g.weighted is not None and not g.weighted[p] else reason
    return out


def _limit_notes(rules: Rules, name: str, cap: int, previous: int, tainted: bool) -> list[str]:
    """Why a candidate's limit is below what its free capacity allows (worked out only for placed ones)."""
    out = []
    limit = cap
    high = {n: h for n, _, h in rules.cluster_limits if h is not None}.get(name)
    if high is not None and high < limit:
        limit = high
        out.append(f"clusterLimits max {high}")
    cap_all = rules.max_replicas_per_cluster
    if cap_all is not None and cap_all < limit:
        out.append(f"maxReplicasPerCluster {cap_all}")
    if tainted:
        out.append(f"NoSchedule taint: keeps {previous}, gains none")
    return out


def _select(rules: Rules, g: Group, limit: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, str]:
    """(selected positions in name order, why)."""
    if rules.mode == "ActivePassive":
        open_ = limit > 0
        primary = g.primary & open_
        if primary.any():
            return np.flatnonzero(primary), "primary region"
        if not open_.any():
            return g.zeros[:0], "standby"
        best = int(np.argmax(np.where(open_, scores, -np.inf)))
        return np.flatnonzero(open_ & (g.regions == g.regions[best])), "standby (no primary region available)"
    chosen = g.twice[: len(g)] if g.weighted is None else np.flatnonzero(g.weighted)
    if rules.max_clusters is not None and len(chosen) > rules.max_clusters:
        allowed = set(chosen.tolist())
        ordered = [p for p in by_score(scores) if p in allowed]
        picked: list[int] = []
        seen: set[int] = set()
        for p in ordered:
            if g.region_ids[p] not in seen and limit[p] > 0:
                seen.add(g.region_ids[p])
                picked.append(p)
        picked = picked[: rules.max_clusters]
        picked += [p for p in ordered if p not in picked][: rules.max_clusters - len(picked)]
        chosen = np.array(sorted(picked), dtype=np.int64)
    return chosen, "spread"


def _ramp(
    d: Deployment, g: Group, target: int, divided: bool, in_selection: np.ndarray, previous: np.ndarray,
    weight_sum: float, limit: np.ndarray, ramp_seconds: float, notes: dict[int, list[str]],
) -> np.ndarray:
    """Caps with the return ramp: a selected cluster back less than ``ramp_seconds`` ago grows only to
    ``max(previous, ready replicas it reports, ceil(fraction elapsed * fair share))``."""
    caps = limit.copy()
    for p, fraction in g.ramping:
        if not in_selection[p]:
            continue
        weight = 1.0 if g.weights is None else float(g.weights[p])
        fair = target if not divided else math.ceil(target * weight / weight_sum)
        ramp_cap = max(int(previous[p]), min(d.running.get(g.names[p], 0), fair), math.ceil(fair * fraction))
        if ramp_cap < caps[p]:
            caps[p] = ramp_cap
            # No percentage here: a note that changed every round would be a status write every round.
            notes.setdefault(p, []).append(f"returning: share grows over a {ramp_seconds:g}s ramp")
    return caps


def _spill(
    short: int, alloc: np.ndarray, extra: list[int], in_selection: np.ndarray, previous: np.ndarray,
    caps: np.ndarray, scores: np.ndarray, notes: dict[int, list[str]],
) -> int:
    """Give what the caps left unplaced to unselected candidates: those already running the deployment
    first (they drain gradually), then by score. Returns what is still unplaced."""
    ranked = [p for p in by_score(scores) if not in_selection[p]]
    for p in [p for p in ranked if previous[p] != 0] + [p for p in ranked if previous[p] == 0]:
        if short <= 0:
            break
        take = min(short, int(caps[p]))
        if take > 0:
            alloc[p] = take
            extra.append(p)
            short -= take
            notes.setdefault(p, []).append(
                "overflow from capped clusters" if previous[p] == 0 else "keeps replicas while others ramp up")
    return short


def _spread_regions(
    alloc: np.ndarray, extra: list[int], in_selection: np.ndarray, g: Group, scores: np.ndarray, caps: np.ndarray,
    floors: Mapping[int, int], n: int, notes: dict[int, list[str]],
) -> None:
    """Move single replicas so that ``n`` regions run at least one, where regions with room exist: to the
    best-scoring cluster of an uncovered region, from the largest share (then the last name) in a region
    that keeps another replica."""

    def regions() -> dict[int, int]:
        out: dict[int, int] = {}
        holders = np.flatnonzero(alloc > 0).tolist()
        for p, k in zip(holders, alloc[holders].tolist(), strict=True):
            out[g.region_ids[p]] = out.get(g.region_ids[p], 0) + k
        return out

    if len(set(g.regions[alloc > 0].tolist())) >= n:
        return
    covered = regions()
    for p in by_score(scores):
        if len(covered) >= n:
            return
        if g.region_ids[p] in covered or caps[p] - alloc[p] <= 0:
            continue
        donors = [q for q in np.flatnonzero(alloc > 0).tolist()
                  if alloc[q] > floors.get(q, 0) and covered.get(g.region_ids[q], 0) > 1]
        if not donors:
            return
        donor = max(donors, key=lambda q: (int(alloc[q]), q))
        alloc[donor] -= 1
        alloc[p] += 1
        if not in_selection[p] and p not in extra:
            extra.append(p)
        notes.setdefault(p, []).append("placed to keep minRegions")
        covered = regions()


def decide(d: Deployment, g: Group, inventory: Inventory, ramp_seconds: float, ledger: Ledger) -> Decision:
    """Steps 3 to 8 of place.py's docstring for one deployment, over its candidates' arrays."""
    rules = g.rules
    per_replica = max(1, d.gpus_per_replica)
    flat, capacity = g.pools(inventory, per_replica)
    have = inventory.free[flat]
    cap = have // per_replica
    limit = cap if g.limit is None else np.minimum(cap, g.limit)
    previous = g.previous(d.previous) if d.previous else g.zeros
    if g.no_schedule is not None:
        limit = np.where(g.no_schedule, np.minimum(limit, previous), limit)
    cached = g.nowhere if d.digest is None else inventory.cached(d.digest)[g.rows]
    costs = inventory.cost_of(g, d.model, per_replica, d.spot_share)
    scores = total(Candidates(have, capacity, costs.value, np.full(len(g), costs.cheapest),
                              np.full(len(g), costs.dearest), previous, cached))

    target = d.target
    if rules.mode == "ActiveActive":
        target = max(target, min(rules.min_regions, d.max_replicas))
    selected, why = _select(rules, g, limit, scores)
    divided = rules.division == "Divided"
    # Division order is by name, rotated per deployment: remainder ties never depend on scores (which move
    # with everyone else's placement) and do not always favour the same clusters across deployments.
    n = len(selected)
    order = selected
    if n:
        turn = zlib.crc32(d.key.encode()) % n
        order = np.concatenate((selected[turn:], selected[:turn]))
    weights = g.weights[order] if g.weights is not None else g.ones[:n]
    weight_sum = sum(weights.tolist()) or 1.0
    in_selection = np.zeros(len(g), dtype=bool)
    in_selection[selected] = True

    notes: dict[int, list[str]] = {}
    caps = limit
    if g.ramping:
        caps = _ramp(d, g, target, divided, in_selection, previous, weight_sum, limit, ramp_seconds, notes)
    floors = {p: low for p, low in g.floors.items() if in_selection[p]}

    alloc = np.zeros(len(g), dtype=np.int64)
    extra: list[int] = []  # positions given replicas outside the division, in the order they got them
    if not divided:
        alloc[order] = duplicate(target, caps[order])
        short = target * n - int(alloc.sum())
    else:
        at_floor = np.array([floors.get(p, 0) for p in order.tolist()], dtype=np.int64) if floors else None
        alloc[order] = divide_arrays(target, weights, caps[order], at_floor, previous[order] if d.previous else None)
        short = target - int(alloc.sum())
        if short > 0:  # spill: holders first (drain gradually), then the best others
            short = _spill(short, alloc, extra, in_selection, previous, caps, scores, notes)
        if rules.mode == "ActiveActive" and rules.min_regions > 1:
            _spread_regions(alloc, extra, in_selection, g, scores, caps, floors, rules.min_regions, notes)

    problems: list[str] = []
    if short > 0:
        problems.append(f"{short} replica(s) unplaced: "
                        + ("not enough capacity on allowed clusters" if len(g) else "no cluster passes the filters"))
    if rules.mode == "ActiveActive" and target > 0:
        covered = len(set(g.regions[alloc > 0].tolist()))
        if covered < rules.min_regions:
            problems.append(f"spread over {covered} region(s), fewer than minRegions {rules.min_regions}")

    placed = order[alloc[order] > 0]
    if extra:
        placed = np.concatenate((placed, np.array([p for p in extra if alloc[p] > 0], dtype=np.int64)))
    positions = placed.tolist()
    chosen = in_selection[placed].tolist()
    roles = [why if selected else "spill" for selected in chosen]
    weight_of = [(f"{g.weights[p]:g}/{weight_sum:g}" if g.weights is not None else f"1/{weight_sum:g}")
                 if divided and selected else "" for p, selected in zip(positions, chosen, strict=True)]
    fits = cap[placed]
    tainted = g.no_schedule
    if g.limit is not None or tainted is not None:
        for p, f in zip(positions, fits.tolist(), strict=True):
            is_tainted = tainted is not None and bool(tainted[p])
            fixed = _limit_notes(rules, g.names[p], f, int(previous[p]), is_tainted)
            if fixed:
                notes[p] = [*fixed, *notes.get(p, ())]
    clusters: dict[str, ClusterPlacement] = {}
    ledger.add(
        Shares(clusters, g, roles, weight_of, notes, d.max_replicas, target, divided, per_replica), d, placed,
        alloc[placed], have[placed], previous if d.previous else None, flat[placed] if g.choices else None,
        limit[placed] if limit is not cap else None,
    )
    inventory.free[flat[placed]] -= alloc[placed] * per_replica

    left = alloc == 0
    if divided:
        left &= (previous > 0) | ~in_selection
    filtered: Mapping[str, str] = g.rejected
    if left.any():
        filtered = left_out(g, np.flatnonzero(left).tolist(), (), why)
    return Decision(clusters, filtered, target, problems, int(alloc.sum()))
