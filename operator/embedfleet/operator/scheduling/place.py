"""``place()``: every deployment's per-cluster replica ranges, from inventory and policies. Pure.

For each deployment, in key order (deterministic; earlier ones see more free capacity):

1. policy   resolve the applicable PlacementPolicy; a contradicting inline field rejects the deployment.
2. filter   health, region lock, residency, GPU type, NoExecute taints, the spoke's platform policy
            (cached per rules and policy verdicts). When replicas stay unplaced, the spokes whose policy
            refuses the deployment are named among its problems (the hub's ``Placed=False`` message).
3. caps     free capacity of the chosen resource pool, per-cluster max, NoSchedule (keep, don't grow),
            and the *return ramp*: a cluster that came back less than ``ramp_seconds`` ago may grow only to
            ``max(previous, ceil(fraction_elapsed * fair share))``; what it may not take yet stays where it
            runs now (gradual move back, no thundering herd, healthy replicas kept until then).
4. score    order candidates (free capacity, price, cached weights, stickiness).
5. select   ActiveActive/RegionLocked: all candidates (or the best ``maxClusters``, regions first);
            ActivePassive: candidates in the primary regions, else the best-scoring standby region.
6. divide   Duplicated (each selected cluster runs the target) or Divided (by weight, floors first).
7. spill    what the caps left unplaced goes to other candidates: first those already running it, then by
            score. Filters are never relaxed, so a region lock holds during failover too.
8. spread   ActiveActive moves single replicas so at least ``minRegions`` regions run one, while that
            many regions have room.

Failover needs no special case: an unavailable cluster fails the health filter, so its share is divided
over the remaining allowed clusters by the same rules, in the same call.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from embedfleet.operator.scheduling.divide import divide, duplicate
from embedfleet.operator.scheduling.filters import SpokePolicy, no_schedule, resource_for, run_filters
from embedfleet.operator.scheduling.model import (
    CPU,
    Cluster,
    ClusterPlacement,
    Deployment,
    Placement,
    Policy,
    ReplicaRange,
)
from embedfleet.operator.scheduling.policy import Rules, resolve
from embedfleet.operator.scheduling.scores import CACHED_POINTS, FREE_POINTS, PRICE_POINTS, STICKY_POINTS

DEFAULT_RAMP_SECONDS = 60.0


class _Candidate:
    __slots__ = ("cap", "cluster", "limit", "name", "notes", "prev", "resource", "score")

    def __init__(self, cluster: Cluster, resource: str, cap: int, limit: int, prev: int) -> None:
        self.cluster = cluster
        self.name = cluster.name
        self.resource = resource
        self.cap = cap
        self.limit = limit
        self.prev = prev
        self.notes: list[str] | None = None
        self.score = 0.0

    def note(self, text: str) -> None:
        if self.notes is None:
            self.notes = []
        self.notes.append(text)


def _limits(rules: Rules) -> tuple[dict[str, int], dict[str, int]]:
    floors = {c: low for c, low, _ in rules.cluster_limits if low > 0}
    maxes = {c: high for c, _, high in rules.cluster_limits if high is not None}
    return floors, maxes


def _ramp_fraction(cluster: Cluster, now: float, ramp_seconds: float) -> float:
    if cluster.available_since is None or ramp_seconds <= 0:
        return 1.0
    return max(0.0, min(1.0, (now - cluster.available_since) / ramp_seconds))


def _select(rules: Rules, ordered: list[_Candidate]) -> tuple[list[_Candidate], str]:
    if rules.mode == "ActivePassive":
        primary = [c for c in ordered if c.cluster.region in rules.primary_regions and c.limit > 0]
        if primary:
            return primary, "primary region"
        standby = [c for c in ordered if c.limit > 0]
        if not standby:
            return [], "standby"
        region = standby[0].cluster.region
        return [c for c in standby if c.cluster.region == region], "standby (no primary region available)"
    chosen = ordered
    if rules.weights:
        weights = dict(rules.weights)
        chosen = [c for c in chosen if weights.get(c.name, 0) > 0]
    if rules.max_clusters is not None and len(chosen) > rules.max_clusters:
        first_per_region: list[_Candidate] = []
        seen: set[str] = set()
        for c in chosen:
            if c.cluster.region not in seen and c.limit > 0:
                seen.add(c.cluster.region)
                first_per_region.append(c)
        picked = first_per_region[: rules.max_clusters]
        picked += [c for c in chosen if c not in picked][: rules.max_clusters - len(picked)]
        chosen = picked
    return chosen, "spread"


def _spread_regions(
    alloc: dict[str, int], ordered: list[_Candidate], caps: dict[str, int], floors: Mapping[str, int], n: int
) -> None:
    """Move single replicas so that ``n`` regions run at least one, where regions with room exist."""
    region_of = {c.name: c.cluster.region for c in ordered}

    def regions() -> dict[str, int]:
        out: dict[str, int] = {}
        for name, k in alloc.items():
            if k > 0:
                out[region_of[name]] = out.get(region_of[name], 0) + k
        return out

    covered = regions()
    for c in ordered:  # best score first
        if len(covered) >= n:
            return
        if c.cluster.region in covered or caps.get(c.name, 0) - alloc.get(c.name, 0) <= 0:
            continue
        donors = [d for d, k in alloc.items() if k > floors.get(d, 0) and covered.get(region_of[d], 0) > 1]
        if not donors:
            return
        donor = max(donors, key=lambda d: (alloc[d], d))
        alloc[donor] -= 1
        alloc[c.name] = alloc.get(c.name, 0) + 1
        c.note("placed to keep minRegions")
        covered = regions()


@dataclass(frozen=True, slots=True)
class _Static:
    """Per (rules, resource need) group: what does not change while deployments are placed."""

    cluster: Cluster
    resource: str | None  # None: several GPU types allowed, chosen per deployment by free capacity
    capacity: int
    price_points: float
    price: float


def _group(rules: Rules, gpu: bool, passed: list[Cluster]) -> list[_Static]:
    picks = []
    for cluster in passed:
        if not gpu:
            picks.append((cluster, CPU))
            continue
        types = rules.gpu_types or tuple(sorted({g.type for g in cluster.gpus}))
        present = [t for t in types if cluster.capacity(t) > 0]
        picks.append((cluster, present[0] if len(present) == 1 else None))
    prices = [c.price(r) if r else min(c.price(t) for t in {g.type for g in c.gpus}) for c, r in picks]
    cheapest, dearest = (min(prices), max(prices)) if prices else (0.0, 0.0)
    spread = dearest - cheapest
    return [
        _Static(
            c,
            r,
            c.capacity(r) if r else 0,
            PRICE_POINTS * (dearest - p) / spread if spread > 0 else PRICE_POINTS,
            p,
        )
        for (c, r), p in zip(picks, prices, strict=True)
    ]


def _candidates(
    d: Deployment, rules: Rules, group: list[_Static], free: dict[str, dict[str, int]], per_replica: int
) -> list[_Candidate]:
    _, maxes = _limits(rules)
    cap_all = rules.max_replicas_per_cluster
    previous = d.previous
    digest = d.digest
    out = []
    for st in group:
        cluster = st.cluster
        name = cluster.name
        pool = free[name]
        resource = st.resource
        capacity = st.capacity
        if resource is None:
            resource = resource_for(rules, d.gpus_per_replica, cluster, pool)
            capacity = cluster.capacity(resource)
        have = pool.get(resource, 0)
        cap = have // per_replica
        prev = previous.get(name, 0) if previous else 0
        c = _Candidate(cluster, resource, cap, cap, prev)
        c.score = (FREE_POINTS * have / capacity if capacity > 0 else 0.0) + st.price_points
        if prev > 0:
            c.score += STICKY_POINTS
        if digest is not None and digest in cluster.cached_digests:
            c.score += CACHED_POINTS
        if maxes:
            high = maxes.get(name)
            if high is not None and high < c.limit:
                c.limit = high
                c.note(f"clusterLimits max {high}")
        if cap_all is not None and cap_all < c.limit:
            c.limit = cap_all
            c.note(f"maxReplicasPerCluster {cap_all}")
        if cluster.taints and no_schedule(rules, cluster):
            c.limit = min(c.limit, prev)
            c.note(f"NoSchedule taint: keeps {prev}, gains none")
        out.append(c)
    return out


def _place_one(
    d: Deployment,
    rules: Rules,
    group: list[_Static],
    free: dict[str, dict[str, int]],
    now: float,
    ramp_seconds: float,
) -> tuple[dict[str, ClusterPlacement], dict[str, str], int, list[str]]:
    per_replica = max(1, d.gpus_per_replica)
    cands = _candidates(d, rules, group, free, per_replica)
    prices = {st.cluster.name: st.price for st in group}
    cands.sort(key=lambda c: (-c.score, c.name))
    by_name = {c.name: c for c in cands}

    target = d.target
    if rules.mode == "ActiveActive":
        target = max(target, min(rules.min_regions, d.max_replicas))
    selected, why = _select(rules, cands)
    weights = dict(rules.weights) if rules.weights else {}
    # Division order is by name, rotated per deployment: remainder ties never depend on scores (which move
    # with everyone else's placement) and do not always favour the same clusters across deployments.
    names = sorted(c.name for c in selected)
    if names:
        turn = zlib.crc32(d.key.encode()) % len(names)
        names = names[turn:] + names[:turn]
    weight_of = {n: float(weights.get(n, 1)) for n in names}
    weight_sum = sum(weight_of.values()) or 1.0

    caps = {c.name: c.limit for c in cands}
    for c in selected:
        fraction = _ramp_fraction(c.cluster, now, ramp_seconds)
        if fraction < 1.0:
            fair = target if rules.division == "Duplicated" else math.ceil(target * weight_of[c.name] / weight_sum)
            ramp_cap = max(c.prev, min(d.running.get(c.name, 0), fair), math.ceil(fair * fraction))
            if ramp_cap < caps[c.name]:
                caps[c.name] = ramp_cap
                # No percentage here: a note that changed every round would be a status write every round.
                c.note(f"returning: share grows over a {ramp_seconds:g}s ramp")
    floors_cfg, _ = _limits(rules)
    floors = {n: floors_cfg[n] for n in names if n in floors_cfg}

    if rules.division == "Duplicated":
        alloc = duplicate(target, names, caps)
        short = sum(max(0, target - k) for k in alloc.values())
    else:
        alloc = divide(target, names, weight_of, caps, floors, d.previous)
        short = target - sum(alloc.values())
        if short > 0:  # spill: holders first (drain gradually), then the best others
            others = sorted((c for c in cands if c.name not in alloc), key=lambda c: c.prev == 0)
            for c in others:
                if short <= 0:
                    break
                take = min(short, caps[c.name])
                if take > 0:
                    alloc[c.name] = take
                    short -= take
                    c.note("overflow from capped clusters" if c.prev == 0 else "keeps replicas while others ramp up")
        if rules.mode == "ActiveActive" and rules.min_regions > 1:
            _spread_regions(alloc, cands, caps, floors, rules.min_regions)

    problems: list[str] = []
    if short > 0:
        why = "not enough capacity on allowed clusters" if cands else "no cluster passes the filters"
        problems.append(f"{short} replica(s) unplaced: {why}")
    if rules.mode == "ActiveActive" and target > 0:
        covered = {by_name[n].cluster.region for n, k in alloc.items() if k > 0}
        if len(covered) < rules.min_regions:
            problems.append(f"spread over {len(covered)} region(s), fewer than minRegions {rules.min_regions}")

    out: dict[str, ClusterPlacement] = {}
    divided = rules.division == "Divided"
    for name, k in alloc.items():
        if k <= 0:
            continue
        c = by_name[name]
        pool = free[name]
        room_after = pool.get(c.resource, 0) // per_replica - k
        ceiling = d.max_replicas if not divided else (math.ceil(d.max_replicas * k / target) if target else 0)
        high = max(k, min(ceiling, k + max(0, room_after), max(c.limit, k)))
        pool[c.resource] = pool.get(c.resource, 0) - k * per_replica
        out[name] = ClusterPlacement(
            ReplicaRange(k, k, high),
            c.cluster.region,
            c.resource,
            role=why if name in weight_of else "spill",
            score=c.score,
            price=prices.get(name, 0.0),
            weight=f"{weight_of[name]:g}/{weight_sum:g}" if divided and name in weight_of else "",
            notes=tuple(c.notes or ()),
        )
    not_chosen = {
        c.name: "weight 0 (not in spec.placement.weights)"
        if weights and weights.get(c.name, 0) <= 0
        else f"not selected ({why})"
        for c in cands
        if c.name not in out and (c.prev > 0 or c.name not in weight_of or not divided)
    }
    return out, not_chosen, target, problems


def _refusals(
    spoke: SpokePolicy, rules: Rules, gpu: bool, inventory: tuple[Cluster, ...], rejected: Mapping[str, str]
) -> list[str]:
    """``<cluster>: <why its policy refuses it>`` for each cluster left out for that reason (not for one an
    earlier filter already excluded); only worked out for a deployment that is short."""
    out = []
    for cluster in inventory:
        reason = rejected.get(cluster.name)
        if reason is not None and reason == spoke(rules, gpu, cluster):
            out.append(f"{cluster.name}: {reason}")
    return out


def place(
    deployments: Iterable[Deployment],
    clusters: Iterable[Cluster],
    policies: Sequence[Policy] = (),
    now: float = 0.0,
    *,
    ramp_seconds: float = DEFAULT_RAMP_SECONDS,
) -> dict[str, Placement]:
    """Deployment key -> Placement. Same inputs, same output; see the module docstring for the pipeline."""
    inventory = tuple(sorted(clusters, key=lambda c: c.name))
    free: dict[str, dict[str, int]] = {}
    for c in inventory:
        pool = {g.type: 0 for g in c.gpus}
        for g in c.gpus:
            pool[g.type] += g.count
        pool["cpu"] = c.cpu_replicas
        free[c.name] = pool
    filtered_cache: dict[tuple[Rules, bool, SpokePolicy | None], tuple[list[_Static], dict[str, str]]] = {}
    resolved_cache: dict[tuple[object, ...], tuple[Rules | None, str | None, list[str]]] = {}
    result: dict[str, Placement] = {}
    for d in sorted(deployments, key=lambda x: x.key):
        key = (d.intent, d.namespace_labels, d.gpu_type)
        if key not in resolved_cache:
            resolved_cache[key] = resolve(d.intent, policies, dict(d.namespace_labels), d.gpu_type)
        rules, policy_name, problems = resolved_cache[key]
        if rules is None:
            result[d.key] = Placement({}, {}, accepted=False, policy=policy_name, problems=tuple(problems))
            continue
        gpu = d.gpus_per_replica > 0
        spoke = SpokePolicy.of(d.refused)
        if (rules, gpu, spoke) not in filtered_cache:
            passed, rejected = run_filters(rules, gpu, inventory, (spoke,) if spoke else ())
            filtered_cache[(rules, gpu, spoke)] = (_group(rules, gpu, passed), rejected)
        group, rejected = filtered_cache[(rules, gpu, spoke)]
        chosen, not_chosen, target, problems = _place_one(d, rules, group, free, now, ramp_seconds)
        if spoke is not None and (problems or sum(c.range.desired for c in chosen.values()) < target):
            problems += _refusals(spoke, rules, gpu, inventory, rejected)
        filtered: Mapping[str, str] = {**rejected, **not_chosen} if not_chosen else rejected
        result[d.key] = Placement(
            chosen, filtered, accepted=True, policy=policy_name, mode=rules.mode, target=target,
            problems=tuple(problems),
        )
    return result
