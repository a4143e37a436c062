"""Status of an EmbeddingDeployment from what the cluster shows. Pure: dicts in, dicts out.

The handlers own ``status.conditions``, ``status.replicas.current/ready``, ``status.cachedNodes`` /
``totalNodes``, ``status.selector``, ``status.image``, ``status.observedGeneration`` and, through the rollout decision
(rollout/revisions.py), ``status.revisions`` / ``currentRevision`` / ``queryVectorSpace`` / ``rollout`` and
the ``RolloutBlocked`` condition. The autoscaler daemon owns
``status.replicas.desired`` (after its first decision), ``status.inFlight`` and
``status.lastScaleDecision`` and ``status.probeDrift`` (which ``Degraded`` folds in, see
rollout/drift.py). Conditions are one list (a merge patch replaces lists whole), so only the
handlers write it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from embedfleet.operator.rollout import drift

CONDITION_ORDER = ("Accepted", "CacheReady", "Available", "Scaling", "Degraded", "RolloutBlocked")


def condition(
    type_: str, ok: bool | None, reason: str, message: str = "", generation: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": type_,
        "status": "Unknown" if ok is None else ("True" if ok else "False"),
        "reason": reason,
        "message": message,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(
    old: list[Mapping[str, Any]] | None, new: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """New conditions over old ones; lastTransitionTime moves only when a condition's status flips."""
    by_type = {c.get("type"): dict(c) for c in (old or [])}
    for cond in new:
        previous = by_type.get(cond["type"])
        same = previous is not None and previous.get("status") == cond["status"]
        stamp = previous.get("lastTransitionTime") if same and previous else None
        by_type[cond["type"]] = {**cond, "lastTransitionTime": stamp or now}
    known = [by_type.pop(t) for t in CONDITION_ORDER if t in by_type]
    return known + [by_type[t] for t in sorted(by_type, key=str)]


def without_times(conditions: list[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conditions or []]


def observed_conditions(
    *,
    deployment: Mapping[str, Any] | None,
    cache_nodes: tuple[int, int] | None,
    desired: int,
    generation: int | None,
    probe_drift: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(CacheReady/Available/Scaling/Degraded conditions, status fields) from the live objects, and
    ``status.probeDrift`` as the autoscaler daemon last wrote it (a drifted probe is Degraded too)."""
    dep_status = (deployment or {}).get("status") or {}
    current = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    fields: dict[str, Any] = {"replicas": {"current": current, "ready": ready}}
    image = runtime_image(deployment)
    if image is not None:
        fields["image"] = image

    if cache_nodes is not None:  # pre-pull on: (nodes labelled ready for this tenant, nodes its pools select)
        cached, total = cache_nodes
        fields["cachedNodes"], fields["totalNodes"] = cached, total
        cache = condition(
            "CacheReady",
            cached > 0,
            "Cached" if cached else "Pulling",
            f"weights verified on {cached}/{total} nodes",
            generation,
        )
    else:
        cache = condition(
            "CacheReady", True, "PrePullDisabled", "each pod fetches (or mounts) the model itself", generation
        )

    dep_conditions = {c.get("type"): c for c in dep_status.get("conditions") or []}
    dep_available = dep_conditions.get("Available") or {}
    if desired == 0:
        available = condition("Available", True, "ScaledToZero", "no replicas requested", generation)
    elif deployment is None:
        available = condition("Available", False, "NoDeployment", "the runtime Deployment does not exist yet",
                              generation)
    elif dep_available.get("status") == "True" and ready > 0:
        available = condition(
            "Available", True, "ReplicasReady", f"{ready}/{desired} replicas ready", generation
        )
    else:
        # The Deployment's own verdict (MinimumReplicasUnavailable, ...) is the truth; say why.
        reason = dep_available.get("reason") or "NoReadyReplicas"
        detail = dep_available.get("message") or "the Deployment reports no availability yet"
        available = condition(
            "Available", False, reason, f"{ready}/{desired} replicas ready: {detail}", generation
        )

    scaling_now = current != desired or updated < min(current, desired)
    scaling = condition(
        "Scaling",
        scaling_now,
        "Converging" if scaling_now else "Stable",
        f"{current} current, {updated} updated, {desired} desired",
        generation,
    )

    failures = [
        f"{c.get('type')}: {c.get('message') or c.get('reason')}"
        for c in dep_status.get("conditions") or []
        if (c.get("type") == "ReplicaFailure" and c.get("status") == "True")
        or (c.get("type") == "Progressing" and c.get("status") == "False")
    ]
    degraded = condition(
        "Degraded",
        bool(failures),
        "DeploymentFailing" if failures else "Healthy",
        "; ".join(failures),
        generation,
    )
    return [cache, available, scaling, drift.degraded(probe_drift, degraded)], fields


def runtime_image(deployment: Mapping[str, Any] | None) -> str | None:
    """The image of the runtime container of a Deployment as read (None before it exists)."""
    pod = (((deployment or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    return next((c.get("image") for c in pod.get("containers") or [] if c.get("name") == "runtime"), None)


def status_patch(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level status keys whose value differs; empty means nothing to write."""
    current = current or {}
    out: dict[str, Any] = {}
    for key, value in wanted.items():
        have = current.get(key)
        if key == "conditions":
            if without_times(have) != without_times(value):
                out[key] = value
        elif isinstance(value, Mapping) and isinstance(have, Mapping):
            if any(have.get(k) != v for k, v in value.items()):
                out[key] = dict(value)
        elif have != value:
            out[key] = value
    return out
