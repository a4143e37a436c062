"""Kubernetes objects <-> the scheduler's dataclasses, and the spoke manifests and status rows. Pure."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import FleetClusterSpec, PlacementPolicySpec
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, PlacementSpec
from embedfleet.operator.hub.health import Health
from embedfleet.operator.scheduling import (
    Cluster,
    ClusterPlacement,
    Deployment,
    GPUCapacity,
    Intent,
    Policy,
    Taint,
    Toleration,
)

#: Label on every object the hub writes to a spoke; its value is the FleetCluster name.
HUB_MANAGED_LABEL = "embedfleet.dev/hub-managed"
#: Annotation with the hub object's uid, so a re-created hub object is not confused with an old one.
HUB_UID_ANNOTATION = "embedfleet.dev/hub-uid"


def cluster_from(name: str, spec: FleetClusterSpec, health: Health, cached: list[str]) -> Cluster:
    return Cluster(
        name=name,
        region=spec.region,
        provider=spec.provider,
        zones=tuple(spec.zones),
        residency=frozenset(spec.residency),
        gpus=tuple(GPUCapacity(g.type, g.count, g.hourly_price) for g in spec.capacity.gpus),
        cpu_replicas=spec.capacity.cpu_replicas,
        cpu_hourly_price=spec.capacity.cpu_hourly_price,
        available=health.available,
        available_since=health.available_since,
        taints=tuple(Taint(t.key, t.value, t.effect) for t in spec.taints),
        cached_digests=frozenset(cached),
    )


def _tolerations(items: list[Any]) -> tuple[Toleration, ...]:
    return tuple(Toleration(t.key, t.operator, t.value, t.effect) for t in items)


def intent_from(p: PlacementSpec | PlacementPolicySpec) -> Intent:
    division = p.policy if isinstance(p, PlacementSpec) else p.division
    return Intent(
        mode=p.mode,
        regions=tuple(p.regions),
        residency=tuple(p.residency),
        min_regions=p.min_regions,
        primary_regions=tuple(p.primary_regions),
        gpu_types=tuple(p.gpu_types),
        division=division,
        weights=tuple((w.cluster, w.weight) for w in p.weights),
        cluster_limits=tuple((c.cluster, c.min_replicas, c.max_replicas) for c in p.cluster_limits),
        max_replicas_per_cluster=p.max_replicas_per_cluster,
        max_clusters=getattr(p, "max_clusters", None),
        tolerations=_tolerations(p.tolerations),
    )


def policy_from(name: str, spec: PlacementPolicySpec) -> Policy:
    return Policy(
        name=name,
        intent=intent_from(spec),
        priority=spec.priority,
        namespace_selector=tuple(sorted(spec.namespace_selector.match_labels.items())),
    )


def digest_key(digest: str | None) -> str | None:
    """The form spokes report cached weights in (the node label key's suffix, see crd/naming.py)."""
    if not digest:
        return None
    try:
        return naming.cache_label_key(digest)[len(naming.CACHE_LABEL_PREFIX):]
    except ValueError:
        return None


def deployment_from(
    key: str, spec: EmbeddingDeploymentSpec, namespace_labels: Mapping[str, str], target: int,
    previous: Mapping[str, int], running: Mapping[str, int] | None = None,
) -> Deployment:
    return Deployment(
        key=key,
        target=target,
        max_replicas=max(target, spec.autoscaling.max_replicas),
        intent=intent_from(spec.placement),
        namespace_labels=tuple(sorted(namespace_labels.items())),
        gpu_type=spec.runtime.gpu.type,
        gpus_per_replica=spec.runtime.gpu.count,
        digest=digest_key(spec.model.digest),
        previous=dict(previous),
        running=dict(running or {}),
    )


def spoke_manifest(hub_obj: Mapping[str, Any], cluster: str, share: ClusterPlacement) -> dict[str, Any]:
    """The EmbeddingDeployment a spoke runs: the hub's spec with this spoke's bounds, placement removed."""
    meta = hub_obj["metadata"]
    spec = copy.deepcopy(dict(hub_obj.get("spec") or {}))
    spec.pop("placement", None)
    auto = dict(spec.get("autoscaling") or {})
    rng = share.range
    if auto.get("enabled", True):
        auto["minReplicas"] = rng.min
        auto["maxReplicas"] = max(1, rng.max)
        spec.pop("replicas", None)
    else:
        spec["replicas"] = rng.desired
    spec["autoscaling"] = auto
    if share.resource != "cpu":
        runtime = dict(spec.get("runtime") or {})
        runtime["gpu"] = {**dict(runtime.get("gpu") or {}), "type": share.resource}
        spec["runtime"] = runtime
    return {
        "apiVersion": naming.API_VERSION,
        "kind": naming.EMBEDDING_DEPLOYMENT_KIND,
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": {HUB_MANAGED_LABEL: cluster, naming.MANAGED_BY_LABEL: "embedfleet-hub"},
            "annotations": {HUB_UID_ANNOTATION: str(meta.get("uid") or "")},
        },
        "spec": spec,
    }


def drifted(live: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether a spoke's copy differs from what the hub wants (spoke-side edits get reverted)."""
    labels = (live.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in wanted["metadata"]["labels"].items()):
        return True
    return live.get("spec") != wanted["spec"]


def spoke_row(
    name: str, share: ClusterPlacement | None, region: str, spoke_obj: Mapping[str, Any] | None,
    last_seen: str | None,
) -> dict[str, Any]:
    status = (spoke_obj or {}).get("status") or {}
    cache = None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "CacheReady":
            cache = cond.get("reason")
    if status.get("cachedNodes") is not None:
        cache = f"{status.get('cachedNodes')}/{status.get('totalNodes')} nodes"
    replicas = status.get("replicas") or {}
    row: dict[str, Any] = {
        "name": name,
        "region": region,
        "min": share.range.min if share else 0,
        "desired": share.range.desired if share else 0,
        "max": share.range.max if share else 0,
        "ready": replicas.get("ready") if spoke_obj is not None else None,
        "inflight": status.get("inFlight"),
        "cache": cache,
        "lastSeen": last_seen,
        "reasons": list(share.reasons) if share else [],
    }
    return row
