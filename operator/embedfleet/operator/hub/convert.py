"""Kubernetes objects <-> the scheduler's dataclasses; the spoke manifests, status rows and conditions. Pure."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from embedfleet.operator import platform
from embedfleet.operator import status as st
from embedfleet.operator.autoscale_target import DEPRECATION_REASON
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import FleetClusterSpec, PlacementPolicySpec
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, PlacementSpec
from embedfleet.operator.hub.health import Health
from embedfleet.operator.kube import covers
from embedfleet.operator.platform import PlatformPolicy
from embedfleet.operator.rollout import waves
from embedfleet.operator.scheduling import (
    Cluster,
    ClusterPlacement,
    Deployment,
    GPUCapacity,
    Intent,
    Placement,
    Policy,
    Taint,
    Toleration,
)
from embedfleet.operator.scheduling.model import WARM_ROLE

#: Label on every object the hub writes to a spoke; its value is the FleetCluster name.
HUB_MANAGED_LABEL = "embedfleet.dev/hub-managed"
#: Annotation with the hub object's uid, so a re-created hub object is not confused with an old one.
HUB_UID_ANNOTATION = "embedfleet.dev/hub-uid"
#: On a spoke copy: where its gateway may spill requests (scheduling/spill.py; read by gateway/spill.py).
SPILL_ANNOTATION = "embedfleet.dev/spill-to"
#: How a status row's reasons mark the problem of that cluster (first reason, when there is one).
PROBLEM_PREFIX = "problem: "
#: How many of a spoke's problems with a spec its refusal quotes (the rest are counted): enough to act on,
#: short enough for a condition message naming every refusing spoke.
REFUSAL_PROBLEMS = 2
#: Key of a policy the hub could not read; such a spoke is sent nothing (its rules are unknown).
UNREADABLE_POLICY = "unreadable:"


def cluster_from(
    name: str, spec: FleetClusterSpec, health: Health, cached: list[str], policy: str = "",
) -> Cluster:
    return Cluster(
        name=name,
        region=spec.region,
        provider=spec.provider,
        zones=tuple(spec.zones),
        residency=frozenset(spec.residency),
        gpus=tuple(GPUCapacity(g.type, g.count, g.hourly_price, g.spot_hourly_price) for g in spec.capacity.gpus),
        cpu_replicas=spec.capacity.cpu_replicas,
        cpu_hourly_price=spec.capacity.cpu_hourly_price,
        cpu_spot_hourly_price=spec.capacity.cpu_spot_hourly_price,
        available=health.available,
        available_since=health.available_since,
        taints=tuple(Taint(t.key, t.value, t.effect) for t in spec.taints),
        cached_digests=frozenset(cached),
        platform_policy=policy,
    )


def read_policy(raw: str | None) -> tuple[str, PlatformPolicy | str]:
    """(key, rules) of the platform policy a spoke's heartbeat published; rules is a sentence when the hub
    cannot read them. The key is the canonical JSON, so spokes with the same rules share one verdict per
    deployment however their charts spelled them. No policy published (a spoke older than this hub): the
    default PlatformPolicy, the rules a spoke without ``platform`` values enforces."""
    if not raw:
        policy = PlatformPolicy()
    else:
        try:
            policy = PlatformPolicy.model_validate_json(raw)
        except ValidationError as exc:
            fields = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'policy'}: {e['msg']}"
                               for e in exc.errors()[:3])
            return UNREADABLE_POLICY + raw, f"the hub cannot read this spoke's platform policy ({fields})"
    return policy.model_dump_json(by_alias=True), policy


def refusals(raw_spec: Mapping[str, Any], policies: Mapping[str, PlatformPolicy | str]) -> dict[str, str]:
    """Policy key -> why a spoke with that policy would refuse this EmbeddingDeployment spec (raw, camelCase:
    the spoke checks the same fields of the copy it is sent, which differs only in placement, replicas and
    GPU type). Keys it passes are left out. One check per distinct policy, not per cluster or replica.

    A referenced Secret's labels are not checked here: the Secret lives on the spoke, which reports a
    missing label itself (``Accepted=False`` on its copy, shown in the hub's status row)."""
    out: dict[str, str] = {}
    for key, policy in policies.items():
        if isinstance(policy, str):
            out[key] = policy
            continue
        problems = platform.deployment_problems(raw_spec, policy)
        if problems:
            rest = len(problems) - REFUSAL_PROBLEMS
            out[key] = "; ".join(problems[:REFUSAL_PROBLEMS]) + (f" (and {rest} more)" if rest > 0 else "")
    return out


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


def digest_key(digest: str | None, namespace: str) -> str | None:
    """The form spokes report cached weights in (the node label key's suffix, see crd/naming.py and
    spoke/heartbeat.py): per namespace, since a node caches weights for one tenant at a time."""
    if not digest:
        return None
    try:
        return naming.cache_label_key(digest, namespace)[len(naming.CACHE_LABEL_PREFIX):]
    except ValueError:
        return None


def deployment_from(
    key: str, spec: EmbeddingDeploymentSpec, namespace_labels: Mapping[str, str], target: int,
    previous: Mapping[str, int], running: Mapping[str, int] | None = None,
    refused: Mapping[str, str] | None = None,
) -> Deployment:
    """``key`` is ``namespace/name``; ``refused`` comes from `refusals`."""
    namespace = key.split("/", 1)[0]
    return Deployment(
        key=key,
        target=target,
        max_replicas=max(target, spec.autoscaling.max_replicas),
        intent=intent_from(spec.placement),
        namespace_labels=tuple(sorted(namespace_labels.items())),
        gpu_type=spec.runtime.gpu.type,
        gpus_per_replica=spec.runtime.gpu.count,
        digest=digest_key(spec.model.digest, namespace),
        previous=dict(previous),
        running=dict(running or {}),
        refused=dict(refused or {}),
        spot_share=spot_share(spec, target),
    )


def spot_share(spec: EmbeddingDeploymentSpec, target: int) -> float:
    """The share of ``target`` replicas spec.spot lets run on spot nodes (0 without it)."""
    if spec.spot is None:
        return 0.0
    if isinstance(spec.spot.max, str):
        return int(spec.spot.max.rstrip("%")) / 100
    return min(1.0, spec.spot.max / max(1, target))


def spoke_manifest(hub_obj: Mapping[str, Any], cluster: str, share: ClusterPlacement,
                   spill: list[dict[str, str]] | None = None, pin: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The EmbeddingDeployment a spoke runs: the hub's spec with this spoke's bounds, placement removed
    (all but `spillAfterSeconds`, its gateway's spill threshold), where its gateway may spill requests
    (`spill`, from scheduling/spill.py; absent when nowhere) and, with `pin` (rollout/waves.py), the
    identity of the revision this cluster should run and its name."""
    meta = hub_obj["metadata"]
    spec = copy.deepcopy(dict(hub_obj.get("spec") or {}))
    placement = spec.pop("placement", None) or {}
    if placement.get("spillAfterSeconds") is not None:
        spec["placement"] = {"spillAfterSeconds": placement["spillAfterSeconds"]}
    annotations: dict[str, str] = {}
    if pin is not None:
        waves.apply_pin(spec, annotations, pin)
    auto = dict(spec.get("autoscaling") or {})
    rng = share.range
    if share.role == WARM_ROLE:
        # Weights only: no replica, so no GPU held; the node agents pre-pull (spec.cache.prePull). A failover
        # gives this copy a share, and its autoscaling back.
        auto["enabled"] = False
        spec["replicas"] = 0
    elif auto.get("enabled", True):
        auto["minReplicas"] = rng.min
        auto["maxReplicas"] = max(1, rng.max)
        spec.pop("replicas", None)
    else:
        spec["replicas"] = rng.desired
    spec["autoscaling"] = auto
    if share.resource not in ("cpu", ""):
        runtime = dict(spec.get("runtime") or {})
        runtime["gpu"] = {**dict(runtime.get("gpu") or {}), "type": share.resource}
        spec["runtime"] = runtime
    return {
        "apiVersion": naming.API_VERSION,
        "kind": naming.EMBEDDING_DEPLOYMENT_KIND,
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": {HUB_MANAGED_LABEL: cluster, naming.MANAGED_BY_LABEL: naming.HUB_MANAGED_BY},
            "annotations": {HUB_UID_ANNOTATION: str(meta.get("uid") or ""), **annotations,
                            **({SPILL_ANNOTATION: json.dumps(spill, sort_keys=True, separators=(",", ":"))}
                               if spill else {})},
        },
        "spec": spec,
    }


def spoke_row(
    name: str, share: ClusterPlacement | None, region: str, spoke_obj: Mapping[str, Any] | None,
    last_seen: str | None, problem: str | None = None,
) -> dict[str, Any]:
    """One ``status.clusters`` row. A problem (propagation refused, spoke unreachable or unavailable) comes
    first in ``reasons``, prefixed with PROBLEM_PREFIX. Fields with no value stay ``None`` (the server
    drops them from what it stores), so `status_changes` notices a value that went away."""
    status = (spoke_obj or {}).get("status") or {}
    cache = None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "CacheReady":
            cache = cond.get("reason")
    if status.get("cachedNodes") is not None:
        cache = f"{status.get('cachedNodes')}/{status.get('totalNodes')} nodes"
    replicas = status.get("replicas") or {}
    reasons = [f"{PROBLEM_PREFIX}{problem}"] if problem else []
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
        # The scheduler's score is left out: it moves with the hub's own last decision (stickiness), so
        # it would cost a second status write for every new share, and it orders, never sizes, a share.
        "reasons": [*reasons, *(r for r in (share.reasons if share else ()) if not r.startswith("score "))],
        "revision": status.get("currentRevision"),
    }
    return row


def refusal_of(spoke_obj: Mapping[str, Any] | None) -> str | None:
    """Why the spoke's operator refuses a copy (its ``Accepted=False``), as a row's problem; None when it
    accepts it or has not judged it yet. A missing API-key Secret shows here, with the way out."""
    for cond in ((spoke_obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Accepted" and cond.get("status") == "False":
            message = str(cond.get("message") or cond.get("reason") or "")
            if "Secret" in message:
                message += (" (create it on the spoke, or let the PlacementPolicy copy it: "
                            "propagateSecrets: true)")
            return f"refused by the spoke: {message}"[:600]
    return None


def row_problem(row: Mapping[str, Any] | None) -> str | None:
    """The problem a status row reports, if any (see spoke_row)."""
    for reason in (row or {}).get("reasons") or []:
        if str(reason).startswith(PROBLEM_PREFIX):
            return str(reason)[len(PROBLEM_PREFIX):]
    return None


def conditions(
    placement: Placement, rows: list[dict[str, Any]], failures: Mapping[str, str], unavailable: Mapping[str, str],
    generation: int | None, deprecation: str | None = None,
) -> list[dict[str, Any]]:
    """Accepted, Placed, Available and Degraded of a hub EmbeddingDeployment.

    ``failures``: cluster -> why its share could not be written or verified (a refused write, an
    unreachable API server); ``unavailable``: cluster -> health reason, for clusters that held a copy and
    whose replicas were moved away. ``Placed`` is True only when every share is placed *and* in place on
    its spoke; ``Degraded`` names every cluster with a problem. ``deprecation``: the sentence naming a
    deprecated field the spec relies on (autoscale_target.py): ``Accepted`` says it, reason Deprecated, as
    a spoke's operator says it on its own objects."""
    ready = sum(int(r.get("ready") or 0) for r in rows if not row_problem(r))
    available = st.condition("Available", ready > 0, "ReplicasReady" if ready else "NoReadyReplicas",
                             f"{ready} ready across {len(rows)} cluster(s)", generation)
    if not placement.accepted:
        conflict = "; ".join(placement.problems)
        return [st.condition("Accepted", False, "PolicyConflict", conflict, generation),
                st.condition("Placed", False, "PolicyConflict", "nothing is placed while the spec conflicts",
                             generation),
                available,
                st.condition("Degraded", True, "PolicyConflict", conflict, generation)]
    policy = f" (PlacementPolicy {placement.policy})" if placement.policy else ""
    if deprecation:
        accepted = st.condition("Accepted", True, DEPRECATION_REASON, f"mode {placement.mode}{policy}; {deprecation}",
                                generation)
    else:
        accepted = st.condition("Accepted", True, "Valid", f"mode {placement.mode}{policy}", generation)
    failed = [f"{name}: {text}" for name, text in sorted(failures.items())]
    refused = any(text.startswith(("propagation", "refused")) for text in failures.values())
    gone = [f"{name} unavailable ({reason}), its replicas moved" for name, reason in sorted(unavailable.items())]
    placed = placement.placed
    shares = ", ".join(f"{n}={c.range.desired}" for n, c in sorted(placement.clusters.items()))
    summary = f"{placed}/{placement.target} replicas: {shares or 'none'}"
    if failed:
        placed_c = st.condition("Placed", False, "PropagationFailed" if refused else "ClusterUnreachable",
                                "; ".join([summary, *failed]), generation)
    elif placed < placement.target or placement.problems:
        placed_c = st.condition("Placed", False, "Constrained", "; ".join([summary, *placement.problems]),
                                generation)
    else:
        placed_c = st.condition("Placed", True, "Placed", summary, generation)
    troubles = [*failed, *placement.problems, *gone]
    reason = ("PropagationFailed" if refused else "ClusterUnreachable" if failed else
              "Constrained" if placement.problems else "ClusterUnavailable" if gone else "Healthy")
    degraded = st.condition("Degraded", bool(troubles), reason, "; ".join(troubles), generation)
    return [accepted, placed_c, available, degraded]


def status_changes(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level status keys to write: conditions compared without their transition times, anything
    else by what the live status already holds (``kube.covers``: server defaults and the absence of a
    field we leave empty are no change). Empty means nothing to write."""
    current = current or {}
    out: dict[str, Any] = {}
    for key, value in wanted.items():
        have = current.get(key)
        if key == "conditions":
            if st.without_times(have) != st.without_times(value):
                out[key] = value
        elif not covers(have, value):
            out[key] = value
    return out
