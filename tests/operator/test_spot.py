"""Spot capacity with on-demand fallback: the pure decisions (embedfleet.operator.spot), the CRD field,
and how the two Deployments render. The real control plane runs it in test_spot_real.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from embedfleet.operator import spot
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.render import render, spot_split

DIGEST = "sha256:" + "a" * 64


def _spec(**spot_spec: object) -> EmbeddingDeploymentSpec:
    return EmbeddingDeploymentSpec.model_validate({
        "model": {"source": "hf://org/model", "digest": DIGEST}, "replicas": 4,
        "autoscaling": {"enabled": False}, "spot": {"max": "50%", **spot_spec}})


@given(st.integers(0, 500), st.integers(0, 100), st.integers(0, 600), st.booleans())
def test_a_split_never_runs_fewer_than_asked_nor_spot_beyond_its_cap(total: int, pct: int, stand_ins: int,
                                                                      fallback: bool) -> None:
    cap = spot.spot_cap(total, f"{pct}%")
    assert cap <= total * pct / 100 < cap + 1
    cut = spot.split(total, cap, stand_ins, fallback)
    assert cut.spot == cap and cut.spot + cut.on_demand - cut.fallback == total
    assert 0 <= cut.fallback <= cap  # a stand-in stands in for a spot replica, never for nothing
    assert cut.fallback == (min(stand_ins, cap) if fallback else 0)
    # Whatever spot does, on-demand alone covers the part spot cannot (with fallback: all of it).
    assert cut.on_demand >= total - cap + (min(stand_ins, cap) if fallback else 0)


@given(st.integers(0, 50), st.integers(0, 60))
def test_a_count_is_a_ceiling_in_replicas(total: int, count: int) -> None:
    assert spot.spot_cap(total, count) == min(total, count)


def test_one_replica_never_rides_on_spot_at_a_share() -> None:
    assert spot.spot_cap(1, "70%") == 0 and spot.spot_cap(10, "70%") == 7 and spot.spot_cap(3, "100%") == 3


@given(st.lists(st.tuples(st.floats(0, 5), st.integers(0, 8)), min_size=1, max_size=30), st.floats(0.1, 10))
def test_stand_ins_rise_at_once_and_leave_only_after_the_window(steps: list[tuple[float, int]],
                                                                window: float) -> None:
    keeper, now, seen = spot.StandIns(window), 0.0, []
    for gap, missing in steps:
        now += gap
        seen.append((now, missing))
        kept = keeper.observe(now, missing)
        assert kept >= missing  # a reclaim is answered in the same tick
        assert kept == max(m for t, m in seen if now - t < window or t == now)


def _node(name: str, labels: dict[str, str] | None = None, taints: list[str] = (), ready: str = "True",
          deleting: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "labels": labels or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-27T10:00:00Z"
    return {"metadata": meta, "spec": {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}


@pytest.mark.parametrize(("labels", "is_spot"), [
    ({"embedfleet.dev/capacity-class": "spot"}, True), ({"karpenter.sh/capacity-type": "spot"}, True),
    ({"cloud.google.com/gke-spot": "true"}, True), ({"eks.amazonaws.com/capacityType": "SPOT"}, True),
    ({"kubernetes.azure.com/scalesetpriority": "spot"}, True), ({"karpenter.sh/capacity-type": "on-demand"}, False),
    ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, False), ({}, False)])
def test_spot_nodes_are_known_by_the_clouds_labels(labels: dict[str, str], is_spot: bool) -> None:
    assert spot.node_view(_node("n", labels)).spot is is_spot


def test_a_reclaim_is_a_termination_taint_a_deletion_or_a_lost_node() -> None:
    assert spot.node_view(_node("n")).reclaim is None
    assert spot.node_view(_node("n", taints=["cloud.google.com/impending-node-termination"])).reclaim \
        == "taint cloud.google.com/impending-node-termination"
    assert spot.node_view(_node("n", taints=["aws-node-termination-handler/spot-itn"])).reclaim is not None
    assert spot.node_view(_node("n", deleting=True)).reclaim == "node is being deleted"
    assert spot.node_view(_node("n", ready="Unknown")).reclaim == "node not ready"
    # A spot pool's own taint is how pods opt in, not a reclaim.
    assert spot.node_view(_node("n", taints=["kubernetes.azure.com/scalesetpriority"])).reclaim is None


def _pod(name: str, node: str | None, ready: bool = True, on_spot: bool = True,
         deleting: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "labels": {spot.CAPACITY_LABEL: spot.SPOT} if on_spot else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-27T10:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_serving_spot_pods_are_ready_on_a_healthy_node_and_the_doomed_are_named() -> None:
    nodes = {n.name: n for n in (spot.node_view(_node("s1")),
                                  spot.node_view(_node("s2", taints=["embedfleet.dev/reclaim"])))}
    pods = [_pod("a", "s1"), _pod("b", "s1", ready=False), _pod("c", "s2"), _pod("d", "gone"),
            _pod("e", None), _pod("f", "s1", on_spot=False), _pod("g", "s2", deleting=True)]
    seen = spot.spot_pods(pods, nodes)
    assert seen.serving == 1
    assert seen.doomed == (("c", "s2", "taint embedfleet.dev/reclaim"), ("d", "gone", "node is gone"))


def test_doomed_pods_drain_only_once_their_stand_ins_are_ready() -> None:
    doomed = (("c", "s2", "taint x"),)
    assert spot.to_drain(doomed, on_demand_ready=3, on_demand_wanted=4) == []
    assert spot.to_drain(doomed, on_demand_ready=4, on_demand_wanted=4) == ["c"]
    assert spot.to_drain((), 4, 4) == []


def _deployments(manifests: list[dict[str, object]]) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}  # type: ignore[index]


def _terms(deployment: dict) -> list[list[dict]]:
    affinity = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return [t["matchExpressions"] for t in terms]


def test_spot_renders_two_deployments_that_never_share_a_node_pool() -> None:
    manifests = render("emb", "team", "uid", _spec(),
                       spot_status={"total": 4, "spot": 2, "onDemand": 2, "fallback": 0})
    deps = _deployments(manifests)
    on_demand, on_spot = deps["emb"], deps["emb-spot"]
    assert (on_demand["spec"]["replicas"], on_spot["spec"]["replicas"]) == (2, 2)
    # The on-demand side keeps its selector (immutable); the spot side adds the capacity label to both.
    assert on_demand["spec"]["selector"]["matchLabels"] == {"embedfleet.dev/deployment": "emb",
                                                           "embedfleet.dev/component": "runtime"}
    spot_selector = on_spot["spec"]["selector"]["matchLabels"]
    assert spot_selector[spot.CAPACITY_LABEL] == spot.SPOT
    assert on_spot["spec"]["template"]["metadata"]["labels"].items() >= spot_selector.items()
    # The Service selects both sides.
    (service,) = [m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == "emb"]
    assert on_spot["spec"]["template"]["metadata"]["labels"].items() >= service["spec"]["selector"].items()
    # Every on-demand term excludes every spot label; every spot term requires one, keeping the base rules.
    for term in _terms(on_demand):
        assert {(e["key"], e["values"][0]) for e in term if e["operator"] == "NotIn"} \
            == set(spot.SPOT_NODE_LABELS.items())
    spot_terms = _terms(on_spot)
    assert {(e["key"], e["values"][0]) for t in spot_terms for e in t if e["operator"] == "In"} \
        == set(spot.SPOT_NODE_LABELS.items())
    assert all(any(e["key"] == "node-role.kubernetes.io/control-plane" for e in t) for t in spot_terms)
    tolerated = {(t["key"], t["value"]) for t in on_spot["spec"]["template"]["spec"]["tolerations"]}
    assert set(spot.SPOT_TAINTS) <= tolerated
    assert "tolerations" not in on_demand["spec"]["template"]["spec"]
    spread = on_spot["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
    assert spread == spot_selector
    assert on_demand["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"][
        "matchLabels"] == on_demand["spec"]["selector"]["matchLabels"]


def test_without_a_record_a_new_deployment_starts_without_stand_ins() -> None:
    """Its spot replicas are starting, not failing: the spot daemon raises stand-ins for those that cannot
    run at its first tick."""
    assert spot_split(_spec(), 4, None) == spot.Split(4, 2, 2, 0)
    assert spot_split(_spec(fallback="none"), 4, None) == spot.Split(4, 2, 2, 0)
    # The daemon's record is used while it was made for this total; a new total keeps its stand-ins.
    assert spot_split(_spec(), 4, {"total": 4, "spot": 2, "onDemand": 3, "fallback": 1}) == spot.Split(4, 2, 3, 1)
    assert spot_split(_spec(), 6, {"total": 4, "spot": 2, "onDemand": 3, "fallback": 1}) == spot.Split(6, 3, 4, 1)


def test_without_spot_nothing_changes() -> None:
    spec = EmbeddingDeploymentSpec.model_validate({"model": {"source": "hf://org/model", "digest": DIGEST},
                                                   "replicas": 4, "autoscaling": {"enabled": False}})
    deps = _deployments(render("emb", "team", "uid", spec))
    assert list(deps) == ["emb"] and deps["emb"]["spec"]["replicas"] == 4
    assert all(e["operator"] != "NotIn" for t in _terms(deps["emb"]) for e in t)


@pytest.mark.parametrize("bad", ["70", "150%", "-1%", -1, 10001, True, "half", "7.5%"])
def test_a_bad_max_is_refused_with_its_reason(bad: object) -> None:
    with pytest.raises(ValidationError, match=r"spot\.max"):
        _spec(max=bad)


def test_the_status_view_sums_both_sides() -> None:
    on_demand = {"spec": {"replicas": 3}, "status": {"replicas": 3, "readyReplicas": 1, "updatedReplicas": 3,
                 "conditions": [{"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"}]}}
    on_spot = {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                          "conditions": [{"type": "Available", "status": "True"}]}}
    view = spot.combined(on_demand, on_spot)
    assert view["status"]["readyReplicas"] == 3 and view["status"]["replicas"] == 5
    assert [c["status"] for c in view["status"]["conditions"] if c["type"] == "Available"] == ["True"]
    assert spot.combined(on_demand, None) is on_demand


def test_the_platform_names_its_own_spot_pools_and_reclaim_signals() -> None:
    import json

    from embedfleet.operator import platform

    policy = platform.load({platform.ENV: json.dumps({"spot": {
        "nodeLabels": {"pool.example.com/class": "cheap"}, "taints": [{"key": "pool.example.com/cheap"}],
        "reclaimTaints": ["pool.example.com/going"]}})})
    assert "spot" not in json.loads(policy.model_dump_json(by_alias=True))  # not published to a hub
    deps = _deployments(render("emb", "team", "uid", _spec(),
                               spot_rules=policy.spot))
    assert {(e["key"], e["values"][0]) for t in _terms(deps["emb-spot"]) for e in t if e["operator"] == "In"} \
        == {("pool.example.com/class", "cheap")}
    assert {(e["key"], e["operator"]) for t in _terms(deps["emb"]) for e in t} >= {("pool.example.com/class", "NotIn")}
    assert {"key": "pool.example.com/cheap", "operator": "Equal", "value": "", "effect": "NoSchedule"} \
        in deps["emb-spot"]["spec"]["template"]["spec"]["tolerations"]
    node = _node("n", {"pool.example.com/class": "cheap"}, taints=["pool.example.com/going"])
    view = spot.node_view(node, policy.spot.node_labels, policy.spot.reclaim_taints)
    assert view.spot and view.reclaim == "taint pool.example.com/going"
    assert spot.node_view(_node("n", taints=["embedfleet.dev/reclaim"]), policy.spot.node_labels,
                          policy.spot.reclaim_taints).reclaim is None  # the list was replaced


def test_the_charts_empty_lists_are_the_built_in_ones() -> None:
    from embedfleet.operator import platform

    rules = platform.SpotRules.model_validate({"nodeLabels": {}, "taints": [], "reclaimTaints": []})
    assert rules == platform.SpotRules()
    assert rules.node_labels == dict(spot.SPOT_NODE_LABELS) and rules.taint_pairs() == spot.SPOT_TAINTS


@pytest.mark.parametrize(("fallback", "on_demand", "on_spot", "status", "total"), [
    ("onDemand", 4, 2, {}, 4),  # nothing recorded: the render stood in for every spot replica
    ("none", 2, 2, {}, 4),
    ("onDemand", 3, 2, {"spot": {"total": 4, "fallback": 1}}, 4),
    ("onDemand", 2, 2, {"spot": {"total": 4, "fallback": 0}}, 4)])
def test_the_autoscaler_sees_the_total_not_the_stand_ins(fallback: str, on_demand: int, on_spot: int,
                                                          status: dict, total: int) -> None:
    from embedfleet.operator.handlers.spot import autoscaler_view

    deps = [{"metadata": {"name": "emb"}, "spec": {"replicas": on_demand}, "status": {"readyReplicas": on_demand}},
            {"metadata": {"name": "emb-spot"}, "spec": {"replicas": on_spot}, "status": {"readyReplicas": 1}}]
    view = autoscaler_view(deps, "emb", _spec(fallback=fallback), status)
    assert view is not None
    assert view["spec"]["replicas"] == total and view["status"]["readyReplicas"] == on_demand + 1


def test_the_operator_sums_its_spot_deployments_without_a_deployment_label() -> None:
    from embedfleet.operator import metrics
    from embedfleet.operator.handlers.spot import _Figures

    def gauge(state: str) -> float:
        return metrics.SPOT_REPLICAS.labels(state=state)._value.get()

    reclaimed = metrics.SPOT_RECLAIMED._value.get()
    figures = _Figures()
    figures.record("a/x", spot.Split(4, 2, 3, 1), serving=1, doomed=["x-spot-1"])
    figures.record("b/y", spot.Split(6, 3, 3, 0), serving=5, doomed=[])
    assert (gauge("asked"), gauge("serving"), gauge("stand_in")) == (5, 4, 1)  # serving counts at most asked
    figures.record("a/x", spot.Split(4, 2, 3, 1), serving=1, doomed=["x-spot-1"])  # the same pod: counted once
    assert metrics.SPOT_RECLAIMED._value.get() == reclaimed + 1
    figures.forget("a/x")
    figures.forget("b/y")
    assert (gauge("asked"), gauge("serving"), gauge("stand_in")) == (0, 0, 0)


def _spot_pod(node: str | None, *, ready: bool = False, phase: str = "Pending", reason: str | None = None,
              scheduled: tuple[str, str] | None = None, deleting: bool = False,
              disruption: str | None = None) -> dict[str, object]:
    """A spot pod as the API shows it: its phase, and the conditions a scheduler and kubelet set."""
    meta: dict[str, object] = {"name": "p", "labels": {spot.CAPACITY_LABEL: spot.SPOT}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-27T10:00:00Z"
    conditions: list[dict[str, str]] = [{"type": "Ready", "status": "True" if ready else "False"}]
    if scheduled is not None:
        conditions.append({"type": "PodScheduled", "status": scheduled[0], "reason": scheduled[1]})
    if disruption is not None:
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    status: dict[str, object] = {"phase": phase, "conditions": conditions}
    if reason:
        status["reason"] = reason
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": status}


NODES = {n.name: n for n in (
    spot.node_view(_node("healthy")),
    spot.node_view(_node("reclaimed", taints=["karpenter.sh/disrupted"])),
    spot.node_view(_node("removing", taints=["ToBeDeletedByClusterAutoscaler"])),
    spot.node_view(_node("notready", ready="False")),
    spot.node_view(_node("deleted-node", deleting=True)),
)}


@pytest.mark.parametrize(("what", "pod", "why"), [
    # merely starting: no stand-in
    ("created, not yet looked at by the scheduler", _spot_pod(None), None),
    ("waiting for the scheduler", _spot_pod(None, scheduled=("False", "SchedulerError")), None),
    ("scheduled, pulling its image", _spot_pod("healthy", scheduled=("True", ""), phase="Pending"), None),
    ("running, not Ready yet (loading the model)", _spot_pod("healthy", phase="Running"), None),
    ("serving", _spot_pod("healthy", phase="Running", ready=True), None),
    ("deleted by its Deployment's roll or scale-down", _spot_pod("healthy", phase="Running", deleting=True), None),
    # cannot run: a stand-in
    ("unschedulable: no spot capacity", _spot_pod(None, scheduled=("False", "Unschedulable")), "unschedulable"),
    ("on a node being reclaimed", _spot_pod("reclaimed", phase="Running", ready=True), "taint karpenter.sh/disrupted"),
    ("on a node being removed", _spot_pod("removing", phase="Running"), "taint ToBeDeletedByClusterAutoscaler"),
    ("on a NotReady node", _spot_pod("notready", phase="Running"), "node not ready"),
    ("on a node being deleted", _spot_pod("deleted-node", phase="Running"), "node is being deleted"),
    ("on a node that is gone", _spot_pod("vanished", phase="Running"), "node is gone"),
    ("evicted for node pressure", _spot_pod("healthy", phase="Failed", reason="Evicted"), "failed: Evicted"),
    ("failed", _spot_pod("healthy", phase="Failed"), "failed: Failed"),
    ("preempted", _spot_pod("healthy", phase="Running", deleting=True, disruption="PreemptionByScheduler"),
     "deleted: PreemptionByScheduler"),
    ("evicted through the API", _spot_pod("healthy", phase="Running", deleting=True,
                                          disruption="EvictionByEvictionAPI"), "deleted: EvictionByEvictionAPI"),
])
def test_a_stand_in_only_for_a_spot_pod_that_cannot_run(what: str, pod: dict[str, object], why: str | None) -> None:
    assert spot.cannot_run(pod, NODES) == why, what


def _seen(*pods: dict[str, object]) -> spot.SpotPods:
    return spot.spot_pods(pods, NODES)


@pytest.mark.parametrize(("what", "pods", "cap", "missing"), [
    ("a scale-up from 2 to 4: two new pods starting", [
        _spot_pod("healthy", phase="Running", ready=True), _spot_pod("healthy", phase="Running", ready=True),
        _spot_pod(None), _spot_pod("healthy", phase="Pending")], 4, 0),
    ("a roll with maxUnavailable 1: one old pod going, its successor starting", [
        _spot_pod("healthy", phase="Running", ready=True), _spot_pod("healthy", phase="Running", deleting=True),
        _spot_pod("healthy", phase="Pending")], 2, 0),
    ("a new deployment: nothing created yet", [], 3, 0),
    ("no spot capacity: two unschedulable", [
        _spot_pod("healthy", phase="Running", ready=True), _spot_pod(None, scheduled=("False", "Unschedulable")),
        _spot_pod(None, scheduled=("False", "Unschedulable"))], 3, 2),
    ("a reclaim: one pod on a reclaimed node", [
        _spot_pod("healthy", phase="Running", ready=True), _spot_pod("reclaimed", phase="Running", ready=True)],
     2, 1),
    ("an evicted pod whose replacement serves stands for nothing", [
        _spot_pod("healthy", phase="Failed", reason="Evicted"), _spot_pod("healthy", phase="Running", ready=True),
        _spot_pod("healthy", phase="Running", ready=True)], 2, 0),
    ("an evicted pod whose replacement is starting", [
        _spot_pod("healthy", phase="Failed", reason="Evicted"), _spot_pod("healthy", phase="Running", ready=True),
        _spot_pod(None)], 2, 1),
])
def test_missing_spot_replicas(what: str, pods: list[dict[str, object]], cap: int, missing: int) -> None:
    assert _seen(*pods).missing(cap) == missing, what
