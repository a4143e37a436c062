"""kopf handlers for ModelCache: keep weights on the nodes of some pools, independent of deployments.

The operator creates nothing for a ModelCache: the chart's node agent (`embedfleet cache agent`, one per
node) reads every ModelCache, pulls the weights into the tenant's entry of the node cache and labels the
node. This handler validates the spec (``Accepted``) and reports how far the agents got, counted from
the Nodes' labels (``cachedNodes/totalNodes``, ``CacheReady``).

Objects an older operator rendered per ModelCache (a pre-pull DaemonSet and ServiceAccount in the
tenant's namespace) are deleted on sight; their ClusterRoleBindings point at a ClusterRole the chart no
longer has, so they grant nothing (docs/cache.md says how to remove them).
"""

from __future__ import annotations

import os
from typing import Any

import kopf

from embedfleet.operator import status as st
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import ModelCacheSpec
from embedfleet.operator.handlers.common import cache_nodes, reject, write_status
from embedfleet.operator.handlers.common import now as _now
from embedfleet.operator.handlers.embedding import KUBE, POLICY
from embedfleet.operator.kube import KubeError
from embedfleet.operator.validate import check_model_cache

#: Seconds between cache status refreshes (the agents filling nodes in); short in tests.
STATUS_INTERVAL = float(os.environ.get("EMBEDFLEET_STATUS_INTERVAL", "15"))
RESOURCE = (naming.GROUP, naming.VERSION, naming.MODEL_CACHE_PLURAL)
KIND = naming.MODEL_CACHE_KIND
#: What older operators rendered for a ModelCache, namespaced and owned: removed by `_retire_pullers`.
LEGACY_KINDS = ("DaemonSet", "ServiceAccount")


def _cache_status(
    name: str, namespace: str, spec: ModelCacheSpec, status: Any, generation: int | None
) -> dict[str, Any]:
    assert spec.model.digest is not None  # check_model_cache requires it
    try:
        cached, total = cache_nodes(KUBE, namespace, spec.model.digest, spec.node_selector, spec.node_pools,
                                    POLICY.allow_control_plane)
    except KubeError as exc:
        raise kopf.TemporaryError(f"cannot list nodes for the cache status: {exc}", delay=30) from exc
    conditions = st.merge_conditions(
        (status or {}).get("conditions"),
        [
            st.condition("Accepted", True, "Valid", "spec accepted", generation),
            st.condition(
                "CacheReady",
                cached > 0 and cached == total,
                "Cached" if cached == total and total else ("NoNodes" if not total else "Pulling"),
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


def _retire_pullers(name: str, uid: str | None, namespace: str) -> None:
    try:
        KUBE.prune(KIND, name, uid, namespace, keep=[], kinds=LEGACY_KINDS)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=10) from exc


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
    parsed, problems = check_model_cache(name, dict(spec), POLICY)
    if parsed is None:
        reject(body, patch, status, problems, generation)
        return
    _retire_pullers(name, meta.get("uid"), namespace)
    write_status(patch, status, _cache_status(name, namespace, parsed, status, generation))


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
    parsed, _ = check_model_cache(name, dict(spec), POLICY)
    if parsed is None:
        return
    write_status(patch, status, _cache_status(name, namespace, parsed, status, meta.get("generation")))
