"""The scheduler against a reference: `reference_place` below restates the placement rules the plain way
(one deployment at a time, one cluster at a time, dicts, a sort by score), and hypothesis checks that
``place()`` (arrays, a shortcut for the common case, scores worked out in one batch) decides exactly the
same on small random fleets: every share, range, role, score, price, weight, note, problem and filter
reason, with scores equal to the last bit.

The one deliberate difference from the implementation before the arrays (commit a4181f8): a cluster's role
is the selection's reason even when some replicas stay unplaced (it used to become the unplaced reason, so
an ActivePassive standby short of capacity lost its "standby" role and its gateway the spill targets).
``Placement.filtered`` compares as a mapping; its iteration order is not part of the contract.
"""

from __future__ import annotations

import importlib
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedfleet.operator.scheduling import (
    Cluster,
    Deployment,
    GPUCapacity,
    Intent,
    Placement,
    Policy,
    Taint,
    Toleration,
    place,
)
from embedfleet.operator.scheduling.cost import cost_per_million, params_from_name, prior_rate
from embedfleet.operator.scheduling.divide import divide, divide_arrays
from embedfleet.operator.scheduling.filters import SpokePolicy, no_schedule, run_filters
from embedfleet.operator.scheduling.policy import Rules, resolve
from embedfleet.operator.scheduling.scores import CACHED_POINTS, FREE_POINTS, PRICE_POINTS, STICKY_POINTS
from embedfleet.operator.scheduling.spill import spill_targets

#: The module, not the function ``scheduling.place`` re-exports under the same name.
place_module = importlib.import_module("embedfleet.operator.scheduling.place")

# ---------------------------------------------------------------- the reference

Summary = tuple[Any, ...]


def reference_divide(
    total: int, names: Sequence[str], weights: Mapping[str, float], caps: Mapping[str, int],
    floors: Mapping[str, int], previous: Mapping[str, int],
) -> dict[str, int]:
    """Equal weights with room for the even share: even split, one more for the larger previous, then the
    earlier. Otherwise floors, then water-filling by weight, largest remainder (ties: larger previous,
    earlier), then, given a previous division, step from it one replica at a time toward the exact quotas
    while every cluster stays within one replica of its quota."""
    if not floors and names:
        first = weights.get(names[0], 0)
        base, rest = divmod(total, len(names))
        if first > 0 and all(weights.get(n, 0) == first for n in names) and all(
                caps.get(n, 0) >= base + (1 if rest else 0) for n in names):
            out = dict.fromkeys(names, base)
            for n in sorted(names, key=lambda n: -previous.get(n, 0))[:rest]:  # (stable: ties stay in order)
                out[n] += 1
            return out
    alloc = {n: min(floors.get(n, 0), caps.get(n, 0)) for n in names}
    remaining = total - sum(alloc.values())
    if remaining <= 0:
        return alloc
    room = {n: caps.get(n, 0) - alloc[n] for n in names}
    share: dict[str, float] = {}
    left = float(remaining)
    free = [n for n in names if weights.get(n, 0) > 0 and room[n] > 0]
    while free:
        weight_sum = sum(weights[n] for n in free)
        over = [n for n in free if left * weights[n] / weight_sum >= room[n]]
        if not over:
            share.update({n: left * weights[n] / weight_sum for n in free})
            break
        for n in over:
            share[n] = float(room[n])
            left -= room[n]
        free = [n for n in free if n not in over]
        if left <= 0:
            break
    whole = {n: min(room[n], math.floor(s + 1e-9)) for n, s in share.items()}
    quota = {n: alloc[n] + share.get(n, 0.0) for n in names}
    for n, w in whole.items():
        alloc[n] += w
    rank = {n: i for i, n in enumerate(names)}
    rest = remaining - sum(whole.values())
    for n in sorted((n for n in share if whole[n] < room[n]),
                    key=lambda n: (-(share[n] - whole[n]), -previous.get(n, 0), rank[n]))[:max(0, rest)]:
        alloc[n] += 1
    if not previous:
        return alloc
    kept = {n: min(previous.get(n, 0), caps.get(n, 0)) for n in names}
    step = sum(alloc.values()) - sum(kept.values())
    if abs(step) > len(names):
        return alloc
    for _ in range(max(0, step)):
        room_ = [n for n in names if kept[n] < caps.get(n, 0) and quota[n] > 0]
        if not room_:
            return alloc
        kept[max(room_, key=lambda n: (quota[n] - kept[n], -rank[n]))] += 1
    for _ in range(max(0, -step)):
        over_ = [n for n in names if kept[n] > floors.get(n, 0)]
        if not over_:
            return alloc
        kept[min(over_, key=lambda n: (quota[n] - kept[n], rank[n]))] -= 1
    return kept if all(abs(kept[n] - quota[n]) <= 1.0 + 1e-9 for n in names) else alloc


class Candidate:
    def __init__(self, cluster: Cluster, resource: str, have: int, capacity: int, cap: int, prev: int) -> None:
        self.cluster, self.name, self.region, self.resource = cluster, cluster.name, cluster.region, resource
        self.have, self.capacity, self.cap, self.prev = have, capacity, cap, prev
        self.limit, self.score, self.price, self.cost, self.notes = cap, 0.0, 0.0, 0.0, []


def reference_place(
    deployments: Sequence[Deployment], clusters: Sequence[Cluster], policies: Sequence[Policy] = (),
    now: float = 0.0, ramp_seconds: float = 60.0,
) -> dict[str, Summary]:
    inventory = sorted(clusters, key=lambda c: c.name)
    free: dict[str, dict[str, int]] = {}
    for c in inventory:
        free[c.name] = {}
        for g in c.gpus:
            free[c.name][g.type] = free[c.name].get(g.type, 0) + g.count
        free[c.name]["cpu"] = c.cpu_replicas
    out = {}
    for d in sorted(deployments, key=lambda x: x.key):
        rules, policy, problems = resolve(d.intent, policies, dict(d.namespace_labels), d.gpu_type)
        if rules is None:
            out[d.key] = (False, policy, "ActiveActive", 0, tuple(problems), [], {})
            continue
        out[d.key] = (True, policy, *reference_one(d, rules, inventory, free, now, ramp_seconds))
    return out


def reference_one(
    d: Deployment, rules: Rules, inventory: list[Cluster], free: dict[str, dict[str, int]], now: float,
    ramp_seconds: float,
) -> Summary:
    gpu, per = d.gpus_per_replica > 0, max(1, d.gpus_per_replica)
    spoke = SpokePolicy.of(d.refused)
    passed, rejected = run_filters(rules, gpu, tuple(inventory), (spoke,) if spoke else ())

    def present(c: Cluster) -> list[str]:
        return [t for t in (rules.gpu_types or sorted({g.type for g in c.gpus})) if c.capacity(t) > 0]

    def price(c: Cluster) -> float:
        if not gpu:
            return c.cpu_hourly_price
        types = present(c)
        return c.price(types[0]) if len(types) == 1 else min(g.hourly_price for g in c.gpus)

    def cost(c: Cluster) -> float:  # per million embeddings, at the prior rate of the first present pool
        resource = present(c)[0] if gpu else "cpu"
        return cost_per_million(price(c), prior_rate(resource, params_from_name(d.model)))

    prices = {c.name: price(c) for c in passed}
    costs = {c.name: cost(c) for c in passed}
    cheapest, dearest = min(costs.values(), default=0.0), max(costs.values(), default=0.0)
    maxes = {n: high for n, _, high in rules.cluster_limits if high is not None}
    floors_all = {n: low for n, low, _ in rules.cluster_limits if low > 0}
    cands = []
    for c in passed:
        types = present(c) if gpu else ["cpu"]
        resource = next((t for t in types if free[c.name].get(t, 0) >= d.gpus_per_replica), types[0])
        have = free[c.name].get(resource, 0)
        x = Candidate(c, resource, have, c.capacity(resource), have // per, d.previous.get(c.name, 0))
        x.price, x.cost = prices[c.name], costs[c.name]
        x.score = FREE_POINTS * have / x.capacity + (
            PRICE_POINTS * (dearest - x.cost) / (dearest - cheapest) if dearest > cheapest else PRICE_POINTS)
        x.score += STICKY_POINTS if x.prev > 0 else 0.0
        x.score += CACHED_POINTS if d.digest is not None and d.digest in c.cached_digests else 0.0
        if c.name in maxes and maxes[c.name] < x.limit:
            x.limit = maxes[c.name]
            x.notes.append(f"clusterLimits max {x.limit}")
        if rules.max_replicas_per_cluster is not None and rules.max_replicas_per_cluster < x.limit:
            x.limit = rules.max_replicas_per_cluster
            x.notes.append(f"maxReplicasPerCluster {x.limit}")
        if no_schedule(rules, c):
            x.limit = min(x.limit, x.prev)
            x.notes.append(f"NoSchedule taint: keeps {x.prev}, gains none")
        cands.append(x)
    cands.sort(key=lambda x: (-x.score, x.name))
    by_name = {x.name: x for x in cands}

    target = d.target
    if rules.mode == "ActiveActive":
        target = max(target, min(rules.min_regions, d.max_replicas))
    weights = dict(rules.weights)
    if rules.mode == "ActivePassive":
        primary = [x for x in cands if x.region in rules.primary_regions and x.limit > 0]
        standby = [x for x in cands if x.limit > 0]
        if primary:
            selected, why = primary, "primary region"
        elif standby:
            selected, why = [x for x in standby if x.region == standby[0].region], \
                "standby (no primary region available)"
        else:
            selected, why = [], "standby"
    else:
        selected, why = [x for x in cands if not weights or weights.get(x.name, 0) > 0], "spread"
        if rules.max_clusters is not None and len(selected) > rules.max_clusters:
            firsts: list[Candidate] = []
            for x in selected:
                if x.limit > 0 and x.region not in {y.region for y in firsts}:
                    firsts.append(x)
            picked = firsts[: rules.max_clusters]
            selected = picked + [x for x in selected if x not in picked][: rules.max_clusters - len(picked)]
    names = sorted(x.name for x in selected)
    if names:
        turn = zlib.crc32(d.key.encode()) % len(names)
        names = names[turn:] + names[:turn]
    weight_of = {n: float(weights.get(n, 1)) for n in names}
    weight_sum = sum(weight_of.values()) or 1.0
    divided = rules.division == "Divided"

    caps = {x.name: x.limit for x in cands}
    for x in selected:
        since = x.cluster.available_since
        fraction = 1.0 if since is None or ramp_seconds <= 0 else max(0.0, min(1.0, (now - since) / ramp_seconds))
        if fraction < 1.0:
            fair = target if not divided else math.ceil(target * weight_of[x.name] / weight_sum)
            ramp_cap = max(x.prev, min(d.running.get(x.name, 0), fair), math.ceil(fair * fraction))
            if ramp_cap < caps[x.name]:
                caps[x.name] = ramp_cap
                x.notes.append(f"returning: share grows over a {ramp_seconds:g}s ramp")
    floors = {n: floors_all[n] for n in names if n in floors_all}

    if not divided:
        alloc = {n: min(target, caps[n]) for n in names}
        short = sum(target - k for k in alloc.values())
    else:
        alloc = reference_divide(target, names, weight_of, caps, floors, d.previous)
        short = target - sum(alloc.values())
        for x in [x for x in cands if x.name not in alloc and x.prev != 0] + \
                 [x for x in cands if x.name not in alloc and x.prev == 0]:
            take = min(short, caps[x.name])
            if take > 0:
                alloc[x.name] = take
                short -= take
                x.notes.append("keeps replicas while others ramp up" if x.prev else "overflow from capped clusters")
        if rules.mode == "ActiveActive" and rules.min_regions > 1:

            def regions() -> dict[str, int]:
                counts: dict[str, int] = {}
                for n, k in alloc.items():
                    if k > 0:
                        counts[by_name[n].region] = counts.get(by_name[n].region, 0) + k
                return counts

            for x in cands:
                covered = regions()
                if len(covered) >= rules.min_regions:
                    break
                if x.region in covered or caps[x.name] - alloc.get(x.name, 0) <= 0:
                    continue
                donors = [n for n, k in alloc.items() if k > floors.get(n, 0) and covered[by_name[n].region] > 1]
                if not donors:
                    break
                alloc[max(donors, key=lambda n: (alloc[n], n))] -= 1
                alloc[x.name] = alloc.get(x.name, 0) + 1
                x.notes.append("placed to keep minRegions")

    problems = []
    if short > 0:
        problems.append(f"{short} replica(s) unplaced: "
                        + ("not enough capacity on allowed clusters" if cands else "no cluster passes the filters"))
    covered_regions = {by_name[n].region for n, k in alloc.items() if k > 0}
    if rules.mode == "ActiveActive" and target > 0 and len(covered_regions) < rules.min_regions:
        problems.append(f"spread over {len(covered_regions)} region(s), fewer than minRegions {rules.min_regions}")
    shares = []
    for n, k in alloc.items():
        if k <= 0:
            continue
        x = by_name[n]
        ceiling = d.max_replicas if not divided else (math.ceil(d.max_replicas * k / target) if target else 0)
        high = max(k, min(ceiling, k + max(0, x.cap - k), max(x.limit, k)))
        free[n][x.resource] = free[n].get(x.resource, 0) - k * per
        shares.append((n, (k, k, high), x.region, x.resource, why if n in weight_of else "spill", x.score, x.price,
                       f"{weight_of[n]:g}/{weight_sum:g}" if divided and n in weight_of else "", tuple(x.notes),
                       x.cost))
    placed = {s[0] for s in shares}
    filtered = dict(rejected)
    for x in cands:
        if x.name not in placed and (x.prev > 0 or x.name not in weight_of or not divided):
            filtered[x.name] = ("weight 0 (not in spec.placement.weights)" if weights and weights.get(x.name, 0) <= 0
                                else f"not selected ({why})")
    if spoke is not None and (problems or sum(s[1][1] for s in shares) < target):
        problems += [f"{c.name}: {rejected[c.name]}" for c in inventory
                     if c.name in rejected and rejected[c.name] == spoke(rules, gpu, c)]
    return rules.mode, target, tuple(problems), shares, filtered


def summary(result: dict[str, Placement]) -> dict[str, Summary]:
    return {key: (p.accepted, p.policy, p.mode, p.target, p.problems,
                  [(n, (c.range.min, c.range.desired, c.range.max), c.region, c.resource, c.role, c.score, c.price,
                    c.weight, c.notes, c.cost) for n, c in p.clusters.items()], dict(p.filtered))
            for key, p in result.items()}


# ---------------------------------------------------------------- random fleets

REGIONS = ["r1", "r2", "r3", "r4"]
GPUS = ["l4", "h100", "a100"]
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def fleets(draw: st.DrawFn, most: int = 9) -> list[Cluster]:
    out = []
    for i in range(draw(st.integers(1, most))):
        gpus = tuple(GPUCapacity(t, draw(st.integers(0, 20)), draw(st.sampled_from([0.5, 1.0, 2.5])))
                     for t in draw(st.lists(st.sampled_from(GPUS), max_size=3)))
        taints = draw(st.lists(st.builds(Taint, st.sampled_from(["a", "b"]), st.sampled_from(["", "x"]),
                                         st.sampled_from(["NoSchedule", "NoExecute"])), max_size=1))
        out.append(Cluster(
            name=f"c{i}", region=draw(st.sampled_from(REGIONS)), gpus=gpus, cpu_replicas=draw(st.integers(0, 30)),
            cpu_hourly_price=draw(st.sampled_from([0.1, 0.2, 0.15])), available=draw(st.booleans()) or i == 0,
            available_since=draw(st.none() | st.floats(0, 100)), taints=tuple(taints),
            residency=frozenset(draw(st.sets(st.sampled_from(["gdpr", "hipaa"]), max_size=2))),
            cached_digests=frozenset(draw(st.sets(st.sampled_from(["m1", "m2"]), max_size=2))),
            platform_policy=draw(st.sampled_from(["", "p1", "p2"])),
        ))
    return out


@st.composite
def workloads(draw: st.DrawFn, clusters: int = 9, most: int = 8) -> list[Deployment]:
    names = [f"c{i}" for i in range(clusters)]
    out = []
    for i in range(draw(st.integers(1, most))):
        mode = draw(st.sampled_from(["ActiveActive", "RegionLocked", "ActivePassive", None]))
        regions = tuple(sorted(draw(st.sets(st.sampled_from(REGIONS), min_size=1 if mode == "RegionLocked" else 0,
                                            max_size=3))))
        limits = draw(st.lists(st.tuples(st.sampled_from(names), st.integers(0, 3), st.none() | st.integers(3, 6)),
                               max_size=2, unique_by=lambda t: t[0]))
        intent = Intent(
            mode=mode, regions=regions, primary_regions=(regions or ("r1",))[:1] if mode == "ActivePassive" else (),
            residency=tuple(draw(st.sets(st.sampled_from(["gdpr"]), max_size=1))),
            min_regions=draw(st.none() | st.integers(1, 3)),
            gpu_types=tuple(draw(st.lists(st.sampled_from(GPUS), max_size=2, unique=True))),
            division=draw(st.sampled_from([None, "Divided", "Duplicated"])),
            weights=tuple(draw(st.dictionaries(st.sampled_from(names), st.integers(0, 3), max_size=4)).items()),
            cluster_limits=tuple(limits), max_replicas_per_cluster=draw(st.none() | st.integers(1, 8)),
            max_clusters=draw(st.none() | st.integers(1, 4)),
            tolerations=tuple(draw(st.lists(st.builds(Toleration, st.sampled_from(["a", "b"]), st.just("Exists")),
                                            max_size=1))),
        )
        gpu = draw(st.booleans())
        target = draw(st.integers(0, 30))
        out.append(Deployment(
            key=f"ns/d{i}", target=target, max_replicas=max(1, target + draw(st.integers(-2, 10))), intent=intent,
            gpu_type=draw(st.sampled_from([*GPUS, None])) if gpu else None,
            gpus_per_replica=draw(st.integers(1, 3)) if gpu else 0, digest=draw(st.sampled_from([None, "m1"])),
            previous=draw(st.dictionaries(st.sampled_from([*names, "gone"]), st.integers(0, 6), max_size=4)),
            running=draw(st.dictionaries(st.sampled_from(names), st.integers(0, 6), max_size=2)),
            refused=draw(st.dictionaries(st.sampled_from(["p1", "p2"]), st.just("refused"), max_size=1)),
            model=draw(st.sampled_from(["", "hf://org/bge-small-en", "hf://org/Qwen3-Embedding-8B"])),
        ))
    return out


@st.composite
def plain_workloads(draw: st.DrawFn) -> list[Deployment]:
    """What the even-split shortcut takes: no limits, weights or taints; small targets, big pools, so that
    most deployments fit evenly and some pools fill up."""
    out = []
    for i in range(draw(st.integers(1, 30))):
        mode = draw(st.sampled_from(["ActiveActive", "RegionLocked", "ActivePassive"]))
        regions = tuple(sorted(draw(st.sets(st.sampled_from(REGIONS), min_size=1, max_size=2))))
        intent = Intent(mode=mode, regions=regions if mode == "RegionLocked" else (),
                        primary_regions=regions[:1] if mode == "ActivePassive" else (),
                        min_regions=draw(st.integers(1, 3)) if mode == "ActiveActive" else None)
        gpu = draw(st.booleans())
        out.append(Deployment(
            key=f"ns/d{i:02d}", target=draw(st.integers(0, 12)), max_replicas=draw(st.integers(1, 24)), intent=intent,
            gpu_type=draw(st.sampled_from(GPUS)) if gpu else None,
            gpus_per_replica=draw(st.integers(1, 2)) if gpu else 0,
            digest=draw(st.sampled_from([None, "m1"])),
            previous=draw(st.dictionaries(st.sampled_from([f"c{j}" for j in range(12)]), st.integers(0, 4),
                                          max_size=3)),
        ))
    return out


@st.composite
def big_fleets(draw: st.DrawFn) -> list[Cluster]:
    return [Cluster(f"c{i}", REGIONS[i % 4], cpu_replicas=draw(st.integers(0, 40)),
                    cpu_hourly_price=draw(st.sampled_from([0.1, 0.2])),
                    gpus=(GPUCapacity(GPUS[i % 3], draw(st.integers(0, 30)), 1.0 + i % 2),),
                    cached_digests=frozenset({"m1"} if i % 2 else ()))
            for i in range(draw(st.integers(1, 12)))]


policies = st.lists(st.builds(Policy, st.just("platform"),
                              st.builds(Intent, max_replicas_per_cluster=st.none() | st.integers(2, 10),
                                        min_regions=st.none() | st.integers(1, 2))), max_size=1)


# ---------------------------------------------------------------- properties


@PROPS
@given(fleets(), workloads(), policies, st.floats(0, 150))
def test_place_decides_what_the_reference_decides(
    clusters: list[Cluster], deps: list[Deployment], pols: list[Policy], now: float
) -> None:
    assert summary(place(deps, clusters, pols, now)) == reference_place(deps, clusters, pols, now)


@PROPS
@given(big_fleets(), plain_workloads())
def test_the_even_split_shortcut_decides_what_the_full_pipeline_does(
    clusters: list[Cluster], deps: list[Deployment]
) -> None:
    fast = summary(place(deps, clusters))
    assert fast == reference_place(deps, clusters)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(place_module, "decide_even", lambda *args: None)
        assert summary(place(deps, clusters)) == fast


@PROPS
@given(st.integers(0, 40), st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12)), min_size=1, max_size=8),
       st.none() | st.lists(st.integers(0, 3), min_size=8, max_size=8),
       st.none() | st.lists(st.integers(0, 8), min_size=8, max_size=8))
def test_divide_matches_the_reference(
    total: int, shape: list[tuple[int, int]], floors: list[int] | None, previous: list[int] | None
) -> None:
    names = [f"n{i}" for i in range(len(shape))]
    weights = {n: float(w) for n, (w, _) in zip(names, shape, strict=True)}
    caps = {n: c for n, (_, c) in zip(names, shape, strict=True)}
    floor = dict(zip(names, floors, strict=False)) if floors else {}
    prev = dict(zip(names, previous, strict=False)) if previous else {}
    expected = reference_divide(total, names, weights, caps, floor, prev)
    assert divide(total, names, weights, caps, floor, prev) == expected
    arrays = divide_arrays(total, np.array(list(weights.values())), np.array(list(caps.values()), dtype=np.int64),
                           np.array([floor.get(n, 0) for n in names], dtype=np.int64) if floor else None,
                           np.array([prev.get(n, 0) for n in names], dtype=np.int64) if prev else None)
    assert arrays.tolist() == list(expected.values())


# ---------------------------------------------------------------- the deliberate difference


def test_a_standby_short_of_capacity_keeps_its_role_and_its_spill_targets() -> None:
    """Primary region down, the standby region cannot hold everything: its clusters are still the standby
    (the role used to become "not enough capacity on allowed clusters"), so their gateways may still spill
    to each other."""
    clusters = [Cluster("eu-a", "eu", cpu_replicas=20, available=False),
                Cluster("us-a", "us", cpu_replicas=2), Cluster("us-b", "us", cpu_replicas=2)]
    dep = Deployment("ml/a", 6, 8, Intent(mode="ActivePassive", primary_regions=("eu",)))
    p = place([dep], clusters)["ml/a"]
    assert p.desired() == {"us-a": 2, "us-b": 2}
    assert "2 replica(s) unplaced: not enough capacity on allowed clusters" in p.problems
    assert {c.role for c in p.clusters.values()} == {"standby (no primary region available)"}
    gateways = {"us-a": "https://gw.us-a", "us-b": "https://gw.us-b"}
    assert [t["cluster"] for t in spill_targets(p, "us-a", gateways)] == ["us-b"]
