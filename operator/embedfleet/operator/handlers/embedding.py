"""kopf handlers for EmbeddingDeployment: validate -> render -> apply -> status. Nothing else.

Every step is idempotent: the same spec renders the same manifests, `Kube.apply` skips unchanged
objects and the status is written only when it differs, so kopf may re-run a handler (resume after a
restart, retries) at no cost. An invalid spec is reported in ``Accepted=False`` and creates nothing;
the handler returns normally so kopf does not retry a spec only a user can fix.
"""

from __future__ import annotations

import os
from typing import Any

import kopf

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.handlers import status as st
from embedfleet.operator.handlers.common import now as _now
from embedfleet.operator.handlers.common import reject, write_status
from embedfleet.operator.kube import Kube, KubeError
from embedfleet.operator.render import effective_replicas, render, selector_string
from embedfleet.operator.validate import check

KUBE = Kube()
RESOURCE = (naming.GROUP, naming.VERSION, naming.EMBEDDING_DEPLOYMENT_PLURAL)
KIND = naming.EMBEDDING_DEPLOYMENT_KIND
#: Seconds between status refreshes (ready replicas, cache progress); short in tests.
STATUS_INTERVAL = float(os.environ.get("EMBEDFLEET_STATUS_INTERVAL", "15"))


def _autoscaler_desired(status: Any) -> int | None:
    """The autoscaler's last decision, once it has made one (see handlers/status.py for ownership)."""
    status = status or {}
    if not status.get("lastScaleDecision"):
        return None
    desired = (status.get("replicas") or {}).get("desired")
    return int(desired) if desired is not None else None


def _observe(
    name: str, namespace: str, spec: EmbeddingDeploymentSpec
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    deployment = KUBE.get("Deployment", name, namespace)
    daemonsets = []
    if spec.cache.pre_pull:
        daemonsets = KUBE.list(
            "DaemonSet", namespace, {naming.INSTANCE_LABEL: name, naming.COMPONENT_LABEL: "prepull"}
        )
    return deployment, daemonsets


def _wanted_status(
    name: str,
    namespace: str,
    spec: EmbeddingDeploymentSpec,
    status: Any,
    generation: int | None,
    desired: int,
) -> dict[str, Any]:
    deployment, daemonsets = _observe(name, namespace, spec)
    observed, fields = st.observed_conditions(
        deployment=deployment,
        daemonsets=daemonsets,
        pre_pull=spec.cache.pre_pull,
        desired=desired,
        generation=generation,
    )
    accepted = st.condition("Accepted", True, "Valid", "spec accepted", generation)
    replicas = {**fields.pop("replicas"), "desired": desired}
    conditions = st.merge_conditions((status or {}).get("conditions"), [accepted, *observed], _now())
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": replicas,
        "selector": selector_string(name),
        **fields,
    }


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile(
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
    parsed, problems = check(name, dict(spec))
    if parsed is None:
        reject(body, patch, status, problems, generation, logger)
        return

    uid = meta.get("uid")
    if not uid:
        raise kopf.TemporaryError("metadata.uid is not set yet; owner references need it", delay=5)
    service_monitor = parsed.monitoring.service_monitor and KUBE.has_resource(
        "monitoring.coreos.com/v1", "servicemonitors"
    )
    if parsed.monitoring.service_monitor and not service_monitor:
        logger.info("spec.monitoring.serviceMonitor is set but the ServiceMonitor CRD is not installed")
    desired = effective_replicas(parsed, _autoscaler_desired(status))
    manifests = render(
        name,
        namespace,
        uid,
        parsed,
        autoscaler_desired=_autoscaler_desired(status),
        service_monitor_available=service_monitor,
    )
    try:
        results = {f"{m['kind']}/{m['metadata']['name']}": KUBE.apply(m) for m in manifests}
        pruned = KUBE.prune(KIND, name, uid, namespace, manifests)
    except KubeError as exc:
        if 400 <= exc.status < 500 and exc.status not in (404, 409, 429):
            message = f"the API server refused a rendered object: {exc}"
            kopf.warn(body, reason="ApplyFailed", message=message[:1000])
            raise kopf.TemporaryError(message, delay=30) from exc
        raise kopf.TemporaryError(str(exc), delay=10) from exc
    changed = {key: result for key, result in results.items() if result != "unchanged"}
    if changed or pruned:
        summary = ", ".join(f"{result} {key}" for key, result in changed.items())
        if pruned:
            summary += (", " if summary else "") + "deleted " + ", ".join(pruned)
        kopf.info(body, reason="Applied", message=summary[:1000])
    write_status(patch, status, _wanted_status(name, namespace, parsed, status, generation, desired))


@kopf.timer(*RESOURCE, interval=STATUS_INTERVAL, initial_delay=STATUS_INTERVAL)
def refresh_status(
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    name: str,
    namespace: str,
    patch: kopf.Patch,
    **_: Any,
) -> None:
    """Follow pods becoming ready and caches filling in, which no spec change announces."""
    parsed, _ = check(name, dict(spec))
    if parsed is None:
        return  # reconcile already reported it; nothing we render is running for this spec
    desired = effective_replicas(parsed, _autoscaler_desired(status))
    write_status(
        patch, status, _wanted_status(name, namespace, parsed, status, meta.get("generation"), desired)
    )


@kopf.on.delete(*RESOURCE)
def cleanup(meta: kopf.Meta, name: str, namespace: str, logger: kopf.Logger, **_: Any) -> None:
    """Owner references let a real cluster's GC do this; deleting explicitly also covers the
    cluster-scoped ClusterRoleBinding (which no namespaced owner can own) and clusters without GC."""
    deleted = KUBE.prune(KIND, name, meta.get("uid"), namespace, keep=[])
    if deleted:
        logger.info("deleted %s", ", ".join(deleted))
