"""kopf handlers for ModelCache: keep weights on the nodes of some pools, independent of deployments."""

from __future__ import annotations

import os
from typing import Any

import kopf

from embedfleet.operator import status as st
from embedfleet.operator.crd import naming
from embedfleet.operator.handlers.common import now as _now
from embedfleet.operator.handlers.common import reject, write_status
from embedfleet.operator.handlers.embedding import KUBE
from embedfleet.operator.kube import KubeError
from embedfleet.operator.render import render_model_cache
from embedfleet.operator.validate import check_model_cache

#: Seconds between cache status refreshes (DaemonSets filling in); short in tests.
STATUS_INTERVAL = float(os.environ.get("EMBEDFLEET_STATUS_INTERVAL", "15"))
RESOURCE = (naming.GROUP, naming.VERSION, naming.MODEL_CACHE_PLURAL)
KIND = naming.MODEL_CACHE_KIND
PULLER_KINDS = ("DaemonSet", "ClusterRoleBinding", "ServiceAccount")


def _cache_status(name: str, namespace: str, status: Any, generation: int | None) -> dict[str, Any]:
    daemonsets = KUBE.list(
        "DaemonSet", namespace, {naming.INSTANCE_LABEL: name, naming.COMPONENT_LABEL: "prepull"}
    )
    owned = [ds for ds in daemonsets if ds["metadata"]["name"].startswith(f"{name}-cache-")]
    cached = sum(int((ds.get("status") or {}).get("numberReady") or 0) for ds in owned)
    total = sum(int((ds.get("status") or {}).get("desiredNumberScheduled") or 0) for ds in owned)
    conditions = st.merge_conditions(
        (status or {}).get("conditions"),
        [
            st.condition("Accepted", True, "Valid", "spec accepted", generation),
            st.condition(
                "CacheReady",
                cached > 0 and cached == total,
                "Cached" if cached == total and total else "Pulling",
                f"weights verified on {cached}/{total} nodes",
                generation,
            ),
        ],
        _now(),
    )
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "cachedNodes": cached,
        "totalNodes": total,
    }


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile_cache(
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    name: str,
    namespace: str,
    patch: kopf.Patch,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    generation = meta.get("generation")
    parsed, problems = check_model_cache(name, dict(spec))
    if parsed is None:
        reject(body, patch, status, problems, generation)
        return
    uid = meta.get("uid")
    if not uid:
        raise kopf.TemporaryError("metadata.uid is not set yet; owner references need it", delay=5)
    manifests = render_model_cache(name, namespace, uid, parsed)
    try:
        for manifest in manifests:
            KUBE.apply(manifest)
        KUBE.prune(KIND, name, uid, namespace, manifests, kinds=PULLER_KINDS)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=10) from exc
    write_status(patch, status, _cache_status(name, namespace, status, generation))


@kopf.timer(*RESOURCE, interval=STATUS_INTERVAL, initial_delay=STATUS_INTERVAL)
def refresh_cache_status(
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    name: str,
    namespace: str,
    patch: kopf.Patch,
    **_: Any,
) -> None:
    if check_model_cache(name, dict(spec))[0] is None:
        return
    write_status(patch, status, _cache_status(name, namespace, status, meta.get("generation")))


@kopf.on.delete(*RESOURCE)
def cleanup_cache(meta: kopf.Meta, name: str, namespace: str, **_: Any) -> None:
    KUBE.prune(KIND, name, meta.get("uid"), namespace, keep=[], kinds=PULLER_KINDS)
