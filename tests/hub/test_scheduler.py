"""The global scheduler, pure: table-driven cases for each policy, and hypothesis properties for the
invariants (region lock holds even during failover, active-active keeps N regions while it can, nothing
over capacity, deterministic, stable under a small load change)."""

from __future__ import annotations

from collections import Counter

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
from embedfleet.operator.scheduling.divide import divide

EU1 = Cluster("eu-a", "eu-west-1", residency=frozenset({"gdpr"}), cpu_replicas=20, cpu_hourly_price=0.1)
EU2 = Cluster("eu-b", "eu-west-1", residency=frozenset({"gdpr"}), cpu_replicas=20, cpu_hourly_price=0.2)
EU3 = Cluster("eu-c", "eu-central-1", residency=frozenset({"gdpr"}), cpu_replicas=20, cpu_hourly_price=0.1)
US1 = Cluster("us-a", "us-east-1", cpu_replicas=20, cpu_hourly_price=0.05,
              gpus=(GPUCapacity("nvidia-h100", 8, 4.0),))
US2 = Cluster("us-b", "us-west-2", cpu_replicas=20, cpu_hourly_price=0.05,
              gpus=(GPUCapacity("nvidia-l4", 16, 0.8),))
FLEET = [EU1, EU2, EU3, US1, US2]


def down(cluster: Cluster) -> Cluster:
    return Cluster(**{**{f: getattr(cluster, f) for f in cluster.__slots__}, "available": False})


def replace(cluster: Cluster, **changes: object) -> Cluster:
    return Cluster(**{**{f: getattr(cluster, f) for f in cluster.__slots__}, **changes})


def one(dep: Deployment, clusters: list[Cluster] = FLEET, policies: list[Policy] | None = None,
        now: float = 0.0) -> Placement:
    return place([dep], clusters, policies or [], now)[dep.key]


CASES = [
    # (name, deployment, clusters, expected desired per cluster)
    ("region-locked splits evenly inside its region",
     Deployment("ml/a", 4, 8, Intent(mode="RegionLocked", regions=("eu-west-1",))), FLEET,
     {"eu-a": 2, "eu-b": 2}),
    ("region-locked by residency label",
     Deployment("ml/a", 3, 6, Intent(mode="RegionLocked", residency=("gdpr",))), FLEET,
     {"eu-a": 1, "eu-b": 1, "eu-c": 1}),
    ("region-locked failover stays in region",
     Deployment("ml/a", 4, 8, Intent(mode="RegionLocked", regions=("eu-west-1",))), [down(EU1), EU2, EU3, US1],
     {"eu-b": 4}),
    ("active-active weighted",
     Deployment("ml/b", 6, 12, Intent(weights=(("eu-a", 2), ("us-a", 1)), min_regions=2)), FLEET,
     {"eu-a": 4, "us-a": 2}),
    ("active-active keeps minRegions with a tiny target",
     Deployment("ml/b", 1, 4, Intent(min_regions=3, regions=("eu-west-1", "eu-central-1", "us-east-1"))),
     FLEET, None),
    ("active-passive uses the primary region",
     Deployment("ml/c", 4, 8, Intent(mode="ActivePassive", primary_regions=("us-east-1",))), FLEET,
     {"us-a": 4}),
    ("active-passive fails over to one standby region",
     Deployment("ml/c", 4, 8, Intent(mode="ActivePassive", primary_regions=("us-east-1",),
                                     regions=("us-east-1", "eu-west-1"))), [EU1, EU2, down(US1)],
     {"eu-a": 2, "eu-b": 2}),
    ("GPU type requirement",
     Deployment("ml/d", 3, 6, gpu_type="nvidia-l4", gpus_per_replica=1), FLEET, {"us-b": 3}),
    ("GPU capacity caps, the rest is unplaced",
     Deployment("ml/d", 5, 10, gpu_type="nvidia-h100", gpus_per_replica=2), FLEET, {"us-a": 4}),
    ("duplicated: each cluster runs the whole target",
     Deployment("ml/e", 3, 5, Intent(mode="RegionLocked", regions=("eu-west-1",), division="Duplicated")), FLEET,
     {"eu-a": 3, "eu-b": 3}),
    ("per-cluster min and max",
     Deployment("ml/f", 6, 12, Intent(mode="RegionLocked", regions=("eu-west-1",),
                                      cluster_limits=(("eu-a", 0, 1), ("eu-b", 2, None)))), FLEET,
     {"eu-a": 1, "eu-b": 5}),
    ("NoExecute taint evicts, tolerated taint does not",
     Deployment("ml/g", 4, 8, Intent(mode="RegionLocked", regions=("eu-west-1",),
                                     tolerations=(Toleration("gpu-maintenance", "Exists"),))),
     [replace(EU1, taints=(Taint("drain", "", "NoExecute"),)),
      replace(EU2, taints=(Taint("gpu-maintenance", "x", "NoExecute"),))],
     {"eu-b": 4}),
]


@pytest.mark.parametrize(("name", "dep", "clusters", "expected"), CASES, ids=[c[0] for c in CASES])
def test_table(name: str, dep: Deployment, clusters: list[Cluster], expected: dict[str, int] | None) -> None:
    result = one(dep, clusters)
    assert result.accepted, result.problems
    if expected is not None:
        assert result.desired() == expected
    else:
        regions = {result.clusters[c].region for c in result.desired()}
        assert len(regions) == 3 and result.placed == 3


def test_explains_filters_and_scores() -> None:
    result = one(Deployment("ml/a", 2, 4, Intent(mode="RegionLocked", regions=("eu-west-1",))))
    assert result.filtered["us-a"] == "region us-east-1 not in ['eu-west-1']"
    assert result.filtered["eu-c"].startswith("region eu-central-1")
    reasons = result.clusters["eu-a"].reasons
    assert reasons[0] == "spread" and reasons[1].startswith("score ") and "weight 1/2" in reasons
    down_result = one(Deployment("ml/a", 2, 4), [down(EU1), EU2])
    assert "lease expired" in down_result.filtered["eu-a"]


def test_unplaced_replicas_are_reported() -> None:
    result = one(Deployment("ml/d", 5, 10, gpu_type="nvidia-h100", gpus_per_replica=2))
    assert result.placed == 4 and "1 replica(s) unplaced" in result.problems[0]


def test_policy_defaults_and_conflicts() -> None:
    eu_only = Policy("eu-data", Intent(mode="RegionLocked", regions=("eu-west-1", "eu-central-1")), priority=10,
                     namespace_selector=(("residency", "eu"),))
    other = Policy("catch-all", Intent(min_regions=2), priority=1)
    labels = (("residency", "eu"),)
    defaulted = place([Deployment("ml/a", 3, 6, namespace_labels=labels)], FLEET, [eu_only, other])["ml/a"]
    assert defaulted.policy == "eu-data" and defaulted.mode == "RegionLocked"
    assert {defaulted.clusters[c].region for c in defaulted.desired()} <= {"eu-west-1", "eu-central-1"}
    narrowed = place([Deployment("ml/a", 2, 4, Intent(regions=("eu-west-1",)), labels)], FLEET, [eu_only])["ml/a"]
    assert narrowed.accepted and set(narrowed.desired()) == {"eu-a", "eu-b"}
    widened = place([Deployment("ml/a", 2, 4, Intent(regions=("us-east-1",)), labels)], FLEET, [eu_only])["ml/a"]
    assert not widened.accepted and widened.clusters == {}
    assert "outside PlacementPolicy eu-data" in widened.problems[0]
    contradicting = place([Deployment("ml/a", 2, 4, Intent(mode="ActiveActive"), labels)], FLEET, [eu_only])
    assert "contradicts PlacementPolicy eu-data" in contradicting["ml/a"].problems[0]
    unmatched = place([Deployment("ml/a", 2, 4, Intent(mode="RegionLocked"))], FLEET, [eu_only])["ml/a"]
    assert not unmatched.accepted and "needs regions or residency" in unmatched.problems[0]


def test_return_ramps_gradually_and_keeps_others_until_then() -> None:
    dep = Deployment("ml/a", 8, 16, Intent(mode="RegionLocked", regions=("eu-west-1",)))
    failed = one(dep, [down(EU1), EU2])
    assert failed.desired() == {"eu-b": 8}
    back = replace(EU1, available_since=100.0)
    steps = []
    previous = failed.desired()
    for now in (100.0, 130.0, 160.0, 200.0):
        d = Deployment(dep.key, dep.target, dep.max_replicas, dep.intent, previous=previous)
        result = one(d, [back, EU2], now=now)
        assert result.placed == 8  # never fewer replicas than wanted while moving back
        previous = result.desired()
        steps.append(previous.get("eu-a", 0))
    assert steps == sorted(steps) and steps[0] == 0 and steps[1] in (2, 3) and steps[-1] == 4


def test_a_spoke_back_from_a_partition_keeps_the_pods_it_still_runs() -> None:
    """Its lease expired, its share moved, but its pods kept serving: they stay (up to its fair share),
    and the others give back the same amount, so the total never exceeds the target."""
    dep = Deployment("ml/a", 8, 16, Intent(mode="RegionLocked", regions=("eu-west-1",)))
    back = replace(EU1, available_since=100.0)
    d = Deployment(dep.key, 8, 16, dep.intent, previous={"eu-b": 8}, running={"eu-a": 3, "eu-b": 8})
    result = one(d, [back, EU2], now=100.0)  # ramp fraction 0: without `running` eu-a would get 0
    assert result.desired() == {"eu-a": 3, "eu-b": 5} and result.placed == 8
    greedy = Deployment(dep.key, 8, 16, dep.intent, previous={"eu-b": 8}, running={"eu-a": 9})
    assert one(greedy, [back, EU2], now=100.0).desired()["eu-a"] == 4  # never beyond its fair share


def test_no_schedule_taint_keeps_but_does_not_grow() -> None:
    tainted = replace(EU1, taints=(Taint("maintenance", "", "NoSchedule"),))
    dep = Deployment("ml/a", 6, 12, Intent(mode="RegionLocked", regions=("eu-west-1",)), previous={"eu-a": 2})
    result = one(dep, [tainted, EU2])
    assert result.desired() == {"eu-a": 2, "eu-b": 4}


def test_divide_tie_breaks_favour_previous_holders() -> None:
    names = ["a", "b", "c", "d"]
    assert divide(2, names, dict.fromkeys(names, 1.0), dict.fromkeys(names, 9), previous={"c": 1, "d": 1}) == {
        "a": 0, "b": 0, "c": 1, "d": 1}
    capped = divide(7, names, {"a": 3.0, "b": 1.0, "c": 1.0, "d": 0.0}, {"a": 2, "b": 9, "c": 9, "d": 9})
    assert capped == {"a": 2, "b": 3, "c": 2, "d": 0} or capped == {"a": 2, "b": 2, "c": 3, "d": 0}


# ---------------------------------------------------------------- properties

REGIONS = ["r1", "r2", "r3", "r4"]


@st.composite
def clusters_st(draw: st.DrawFn) -> list[Cluster]:
    n = draw(st.integers(2, 9))
    out = []
    for i in range(n):
        gpus = ()
        if draw(st.booleans()):
            gpus = (GPUCapacity(draw(st.sampled_from(["nvidia-l4", "nvidia-h100"])), draw(st.integers(0, 16)),
                                draw(st.floats(0.5, 5))),)
        out.append(Cluster(
            name=f"c{i}", region=draw(st.sampled_from(REGIONS)), gpus=gpus,
            cpu_replicas=draw(st.integers(0, 30)), cpu_hourly_price=draw(st.floats(0.01, 1)),
            available=draw(st.booleans()) or i == 0,
            available_since=draw(st.none() | st.floats(0, 100)),
            residency=frozenset(draw(st.sets(st.sampled_from(["gdpr", "hipaa"]), max_size=2))),
        ))
    return out


@st.composite
def deployments_st(draw: st.DrawFn) -> list[Deployment]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        mode = draw(st.sampled_from(["ActiveActive", "RegionLocked", "ActivePassive"]))
        regions = tuple(sorted(draw(st.sets(st.sampled_from(REGIONS), min_size=1, max_size=3))))
        intent = Intent(
            mode=mode,
            regions=regions if mode != "ActiveActive" or draw(st.booleans()) else (),
            primary_regions=regions[:1] if mode == "ActivePassive" else (),
            min_regions=draw(st.integers(1, 3)) if mode == "ActiveActive" else None,
            division=draw(st.sampled_from(["Divided", "Duplicated"])),
        )
        gpu = draw(st.booleans())
        target = draw(st.integers(0, 25))
        out.append(Deployment(
            key=f"ns/d{i}", target=target, max_replicas=max(1, target + draw(st.integers(0, 10))), intent=intent,
            gpu_type=draw(st.sampled_from(["nvidia-l4", "nvidia-h100"])) if gpu else None,
            gpus_per_replica=draw(st.integers(1, 4)) if gpu else 0,
            previous=draw(st.dictionaries(st.sampled_from([f"c{j}" for j in range(9)]), st.integers(0, 5),
                                          max_size=4)),
        ))
    return out


PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _usage(result: dict[str, Placement], deps: list[Deployment]) -> Counter[tuple[str, str]]:
    per = {d.key: max(1, d.gpus_per_replica) for d in deps}
    used: Counter[tuple[str, str]] = Counter()
    for key, p in result.items():
        for name, c in p.clusters.items():
            used[(name, c.resource)] += c.range.desired * per[key]
    return used


@PROPS
@given(clusters_st(), deployments_st(), st.floats(0, 200))
def test_capacity_and_region_lock_hold(clusters: list[Cluster], deps: list[Deployment], now: float) -> None:
    result = place(deps, clusters, [], now)
    by_name = {c.name: c for c in clusters}
    used = _usage(result, deps)
    for (name, resource), amount in used.items():
        assert amount <= by_name[name].capacity(resource), (name, resource)  # no cluster over capacity
    total_capacity = sum(c.cpu_replicas + sum(g.count for g in c.gpus) for c in clusters)
    assert sum(used.values()) <= total_capacity
    for d in deps:
        p = result[d.key]
        for name, c in p.clusters.items():
            cluster = by_name[name]
            assert cluster.available  # nothing lands on an expired lease
            if d.intent.regions:
                assert cluster.region in d.intent.regions  # locked, failover or not
            assert 0 <= c.range.min <= c.range.desired <= c.range.max
            if d.gpus_per_replica:
                assert c.range.max * d.gpus_per_replica <= cluster.capacity(c.resource)


@PROPS
@given(clusters_st(), deployments_st())
def test_deterministic(clusters: list[Cluster], deps: list[Deployment]) -> None:
    first = place(deps, clusters, [], 50.0)
    second = place(list(reversed(deps)), list(reversed(clusters)), [], 50.0)
    assert {k: (v.desired(), v.problems) for k, v in first.items()} == {
        k: (v.desired(), v.problems) for k, v in second.items()}


@PROPS
@given(st.integers(2, 4), st.integers(0, 30), st.lists(st.sampled_from(REGIONS), min_size=2, max_size=10),
       st.lists(st.booleans(), min_size=10, max_size=10))
def test_active_active_keeps_n_regions(n: int, target: int, regions: list[str], health: list[bool]) -> None:
    clusters = [Cluster(f"c{i}", r, cpu_replicas=40, available=health[i]) for i, r in enumerate(regions)]
    dep = Deployment("ns/aa", target, max(target, n) + 5, Intent(mode="ActiveActive", min_regions=n))
    p = place([dep], clusters, [], 0.0)["ns/aa"]
    healthy_regions = {c.region for c in clusters if c.available}
    placed_regions = {p.clusters[c].region for c in p.desired()}
    if len(healthy_regions) >= n:
        assert len(placed_regions) >= n
    else:
        assert placed_regions == healthy_regions and any("minRegions" in x for x in p.problems)


@PROPS
@given(st.integers(3, 12), st.integers(10, 200), st.lists(st.integers(1, 5), min_size=12, max_size=12))
def test_small_load_change_moves_only_changed_shares(n: int, target: int, weights: list[int]) -> None:
    clusters = [Cluster(f"c{i:02d}", REGIONS[i % 4], cpu_replicas=1000) for i in range(n)]
    intent = Intent(weights=tuple((f"c{i:02d}", weights[i]) for i in range(n)))
    before = place([Deployment("ns/x", target, target * 2, intent)], clusters)["ns/x"].desired()
    grown = round(target * 1.05)
    after = place([Deployment("ns/x", grown, target * 2, intent, previous=before)], clusters)["ns/x"].desired()
    deltas = [after.get(c, 0) - before.get(c, 0) for c in set(before) | set(after)]
    assert all(d >= 0 for d in deltas)  # growth never takes a replica away from any cluster
    assert sum(1 for d in deltas if d) <= grown - target
