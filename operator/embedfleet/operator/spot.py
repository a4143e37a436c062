"""Spot capacity with on-demand fallback: the pure decisions (docs/spot.md).

A deployment with ``spec.spot`` runs as two Deployments of the same revision: ``<name>`` on on-demand
nodes and ``<name>-spot`` on spot nodes, both behind the one Service and counted by the one autoscaler.
The autoscaler decides the total; `split` divides it: at most ``max`` on spot, the rest on demand, and —
with ``fallback: onDemand`` — one on-demand stand-in for every spot replica that cannot run
(`cannot_run`: unschedulable, on a node being reclaimed, tainted for removal, NotReady or gone, failed or
evicted, or deleted by a disruption), never for one that is merely starting (pending a scheduling decision,
or scheduled on a healthy node and not Ready yet), so scaling up or rolling the spot side raises no
stand-ins. A reclaim therefore raises the on-demand side at once, before the spot capacity returns; the
spot side keeps asking, and once spot replicas have served again for ``returnAfterSeconds`` the stand-ins
go (`StandIns`).

Which nodes are spot, and which node signals mean "being reclaimed", are the platform's (chart values
``platform.spot``); the defaults below know the labels and taints of Karpenter, GKE, EKS, AKS, the
Kubernetes cluster autoscaler and the AWS node termination handler.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Pod label of the spot Deployment's pods (and part of its selector).
CAPACITY_LABEL = "embedfleet.dev/capacity"
SPOT = "spot"
#: Suffix of the spot Deployment's name.
SPOT_SUFFIX = "-spot"

#: Node labels that mark spot capacity (any one is enough).
SPOT_NODE_LABELS: Mapping[str, str] = {
    "embedfleet.dev/capacity-class": "spot",
    "karpenter.sh/capacity-type": "spot",
    "cloud.google.com/gke-spot": "true",
    "cloud.google.com/gke-preemptible": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "kubernetes.azure.com/scalesetpriority": "spot",
}
#: Taints spot node pools carry so that only pods that accept spot land there; spot pods tolerate them.
SPOT_TAINTS: tuple[tuple[str, str], ...] = (
    ("embedfleet.dev/capacity-class", "spot"),
    ("cloud.google.com/gke-spot", "true"),
    ("kubernetes.azure.com/scalesetpriority", "spot"),
)
#: Node taints that announce a reclaim (a termination notice) or a removal.
RECLAIM_TAINTS: tuple[str, ...] = (
    "embedfleet.dev/reclaim",
    "cloud.google.com/impending-node-termination",
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/asg-lifecycle-termination",
    "ToBeDeletedByClusterAutoscaler",
    "node.kubernetes.io/out-of-service",
)


def recorded(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status.spot`` of an EmbeddingDeployment (given its status), as a dict; {} when none is recorded. The one
    reading of it for the autoscaler's view, the resize, the daemon's tick and the render."""
    value = (status or {}).get("spot")
    return dict(value) if isinstance(value, Mapping) else {}


def spot_name(name: str) -> str:
    return f"{name}{SPOT_SUFFIX}"


def spot_cap(total: int, maximum: int | str) -> int:
    """Replicas that may run on spot: a count (at most ``total``) or a share of ``total``, rounded down."""
    if isinstance(maximum, str):
        return math.floor(total * int(maximum.rstrip("%")) / 100)
    return min(max(0, maximum), total)


@dataclass(frozen=True)
class Split:
    total: int
    spot: int
    on_demand: int
    fallback: int


def split(total: int, cap: int, stand_ins: int, fallback: bool) -> Split:
    """The two Deployments' replicas: ``cap`` on spot, the rest on demand plus ``stand_ins`` (at most one per
    spot replica) when falling back. Never fewer than ``total`` asked for in all; never a stand-in without a
    spot replica it stands in for."""
    total, cap = max(0, total), max(0, min(cap, total))
    extra = min(max(0, stand_ins), cap) if fallback else 0
    return Split(total, cap, total - cap + extra, extra)


@dataclass
class StandIns:
    """How many on-demand stand-ins to keep: the spot replicas missing now, or the most missing at any time
    in the last ``return_after`` seconds (spot capacity must hold before the stand-ins leave; a reclaim
    raises them at once)."""

    return_after: float
    history: list[tuple[float, int]] = field(default_factory=list)

    def observe(self, now: float, missing: int) -> int:
        self.history = [(t, m) for t, m in self.history if now - t < self.return_after]
        self.history.append((now, max(0, missing)))
        return max(m for _, m in self.history)


@dataclass(frozen=True)
class NodeView:
    """What the spot decisions need of a node."""

    name: str
    spot: bool
    reclaim: str | None  # why the node is going away; None while it is not


def node_view(node: Mapping[str, Any], spot_labels: Mapping[str, str] = SPOT_NODE_LABELS,
              reclaim_taints: Iterable[str] = RECLAIM_TAINTS) -> NodeView:
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    is_spot = any(labels.get(k) == v for k, v in spot_labels.items())
    reclaim: str | None = None
    taints = {t.get("key") for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, Mapping)}
    hit = sorted(taints & set(reclaim_taints))
    if meta.get("deletionTimestamp"):
        reclaim = "node is being deleted"
    elif hit:
        reclaim = f"taint {hit[0]}"
    else:
        ready = next((c for c in (node.get("status") or {}).get("conditions") or []
                      if isinstance(c, Mapping) and c.get("type") == "Ready"), None)
        if ready is not None and ready.get("status") != "True":
            reclaim = "node not ready"
    return NodeView(str(meta.get("name") or ""), is_spot, reclaim)


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [] if isinstance(c, Mapping))


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or []
                 if isinstance(c, Mapping) and c.get("type") == kind), None)


def cannot_run(pod: Mapping[str, Any], nodes: Mapping[str, NodeView]) -> str | None:
    """Why a spot pod cannot run, or None while it serves or is merely starting (waiting for the
    scheduler's decision, or scheduled on a healthy node and not Ready yet).

    It cannot run when the scheduler found no node for it (``PodScheduled`` False, ``Unschedulable``),
    when it failed (an eviction for node pressure included), when it is being deleted by a disruption (the
    ``DisruptionTarget`` condition: preemption, eviction, the taint manager; a Deployment's own roll or
    scale-down sets none), or when its node is gone, being reclaimed or removed, or not Ready."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"failed: {status.get('reason') or 'Failed'}"
    disrupted = _condition(pod, "DisruptionTarget")
    if meta.get("deletionTimestamp") and disrupted is not None and disrupted.get("status") == "True":
        return f"deleted: {disrupted.get('reason') or 'disruption'}"
    node_name = (pod.get("spec") or {}).get("nodeName")
    if not node_name:
        scheduled = _condition(pod, "PodScheduled")
        if scheduled is not None and scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
            return "unschedulable"
        return None
    node = nodes.get(node_name)
    return "node is gone" if node is None else node.reclaim


@dataclass(frozen=True)
class SpotPods:
    serving: int
    #: (pod name, node name, why) of spot pods still running on a node that is going away.
    doomed: tuple[tuple[str, str, str], ...]
    #: Spot pods that cannot run (`cannot_run`); the ones merely starting are not among them.
    cannot_run: int = 0

    def missing(self, cap: int) -> int:
        """Spot replicas to stand in for: those that cannot run, and never more than the cap's replicas that
        do not serve (a failed pod whose replacement serves stands for nothing)."""
        return min(self.cannot_run, max(0, cap - self.serving))


def spot_pods(pods: Iterable[Mapping[str, Any]], nodes: Mapping[str, NodeView]) -> SpotPods:
    """Spot pods serving (Ready, not terminating, on a node that exists and is not being reclaimed), those on
    a node that is gone or going, and how many cannot run."""
    serving, doomed, stuck = 0, [], 0
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(CAPACITY_LABEL) != SPOT:
            continue
        if cannot_run(pod, nodes) is not None:
            stuck += 1
        if meta.get("deletionTimestamp"):
            continue
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name:
            continue  # pending: not serving, nothing to drain
        node = nodes.get(node_name)
        why = "node is gone" if node is None else node.reclaim
        if why is not None:
            doomed.append((str(meta.get("name") or ""), node_name, why))
        elif _ready(pod):
            serving += 1
    return SpotPods(serving, tuple(sorted(doomed)), stuck)


def to_drain(doomed: Sequence[tuple[str, str, str]], on_demand_ready: int, on_demand_wanted: int) -> list[str]:
    """Spot pods to evict now (gracefully, so they drain before their node dies): only once the on-demand
    side is ready at its full size, so capacity never dips below what was serving."""
    if not doomed or on_demand_ready < on_demand_wanted:
        return []
    return [pod for pod, _, _ in doomed]


# ----------------------------------------------------------------- rendering


def _terms(affinity: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    required = ((affinity or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = (required or {}).get("nodeSelectorTerms") or [{"matchExpressions": []}]
    return [{"matchExpressions": list(t.get("matchExpressions") or [])} for t in terms]


def _with_terms(affinity: Mapping[str, Any] | None, terms: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(affinity or {})
    node = dict(out.get("nodeAffinity") or {})
    node["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": terms}
    out["nodeAffinity"] = node
    return out


def on_demand_pod_spec(pod_spec: Mapping[str, Any], spot_labels: Mapping[str, str] = SPOT_NODE_LABELS
                       ) -> dict[str, Any]:
    """The on-demand side's pod spec: every required term also excludes every spot label."""
    not_spot = [{"key": k, "operator": "NotIn", "values": [v]} for k, v in sorted(spot_labels.items())]
    terms = [{"matchExpressions": t["matchExpressions"] + not_spot} for t in _terms(pod_spec.get("affinity"))]
    return {**pod_spec, "affinity": _with_terms(pod_spec.get("affinity"), terms)}


def spot_pod_spec(pod_spec: Mapping[str, Any], spot_labels: Mapping[str, str] = SPOT_NODE_LABELS,
                  spot_taints: Sequence[tuple[str, str]] = SPOT_TAINTS) -> dict[str, Any]:
    """The spot side's pod spec: required terms ORed over the spot labels (each keeping the base terms'
    rules), and tolerations for the spot pools' taints."""
    terms = [{"matchExpressions": t["matchExpressions"] + [{"key": k, "operator": "In", "values": [v]}]}
             for t in _terms(pod_spec.get("affinity")) for k, v in sorted(spot_labels.items())]
    tolerations = list(pod_spec.get("tolerations") or [])
    tolerations += [{"key": k, "operator": "Equal", "value": v, "effect": "NoSchedule"} for k, v in spot_taints]
    return {**pod_spec, "affinity": _with_terms(pod_spec.get("affinity"), terms), "tolerations": tolerations}


def render_pair(primary: Mapping[str, Any], cut: Split, spot_labels: Mapping[str, str] = SPOT_NODE_LABELS,
                spot_taints: Sequence[tuple[str, str]] = SPOT_TAINTS) -> tuple[dict[str, Any], dict[str, Any]]:
    """(on-demand, spot) Deployments from the primary one as rendered without spot. The on-demand one keeps
    its name and selector (a Deployment's selector cannot change); the spot one adds the capacity label to
    both, so its ReplicaSets own only spot pods, while the Service, PDB and autoscaler select both."""
    spec = dict(primary["spec"])
    template = dict(spec["template"])
    on_demand = {**primary, "spec": {**spec, "replicas": cut.on_demand,
                                     "template": {**template, "spec": on_demand_pod_spec(template["spec"],
                                                                                         spot_labels)}}}
    meta = dict(primary["metadata"])
    tmeta = dict(template["metadata"])
    selector = {**spec["selector"]["matchLabels"], CAPACITY_LABEL: SPOT}
    pod_spec = spot_pod_spec(template["spec"], spot_labels, spot_taints)
    if pod_spec.get("topologySpreadConstraints"):
        pod_spec["topologySpreadConstraints"] = [{**c, "labelSelector": {"matchLabels": selector}}
                                                 for c in pod_spec["topologySpreadConstraints"]]
    spot = {
        **primary,
        "metadata": {**meta, "name": spot_name(meta["name"]), "labels": {**meta["labels"], CAPACITY_LABEL: SPOT}},
        "spec": {**spec, "replicas": cut.spot, "selector": {"matchLabels": selector},
                 "template": {"metadata": {**tmeta, "labels": {**tmeta["labels"], CAPACITY_LABEL: SPOT}},
                              "spec": pod_spec}},
    }
    return on_demand, spot


def combined(on_demand: Mapping[str, Any] | None, spot: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """One view of both Deployments for the status (replica counts summed; Available when either side
    is available with a ready replica). The on-demand side's conditions explain a failure."""
    if spot is None or on_demand is None:
        return on_demand or spot
    a, b = on_demand.get("status") or {}, spot.get("status") or {}
    status = {k: int(a.get(k) or 0) + int(b.get(k) or 0)
              for k in ("replicas", "readyReplicas", "updatedReplicas", "availableReplicas")}
    conditions = [dict(c) for c in a.get("conditions") or []]
    spot_ok = any(c.get("type") == "Available" and c.get("status") == "True" for c in b.get("conditions") or [])
    if spot_ok and int(b.get("readyReplicas") or 0) > 0:
        conditions = [c for c in conditions if c.get("type") != "Available"]
        conditions.append({"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"})
    return {**on_demand, "status": {**a, **status, "conditions": conditions}}
