"""Spot capacity with on-demand fallback: one kopf daemon per EmbeddingDeployment with ``spec.spot``, and
the two helpers the autoscaler uses to see and resize a deployment that runs as two Deployments.

Each tick (``TICK_S``) reads only kopf's in-memory views (nodes, runtime pods, runtime Deployments),
decides with embedfleet.operator.spot, and writes only what changed, in this order: ``status.spot`` (so a
reconcile renders the same split), the Deployments' replicas, then an Event when stand-ins came or went.
Spot pods on a node being reclaimed are evicted (graceful: they drain) once the on-demand side is ready
at its new size, so serving capacity never dips below what the spot pods gave.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import kopf
import kubernetes

from embedfleet.operator import metrics, spot
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.handlers.embedding import POLICY
from embedfleet.operator.kube import Kube, KubeError
from embedfleet.operator.render import effective_replicas, runtime_name, spot_split
from embedfleet.operator.validate import check

log = logging.getLogger(__name__)
KUBE = Kube()
RESOURCE = (naming.GROUP, naming.VERSION, naming.EMBEDDING_DEPLOYMENT_PLURAL)
KIND = naming.EMBEDDING_DEPLOYMENT_KIND
#: How often the daemon looks at its views; a reclaim is acted on within one tick.
TICK_S = 1.0
#: At most this long a tick waits for its status write to show in kopf's view before resizing.
STATUS_VISIBLE_WAIT_S = 2.0
IDLE_RECHECK_S = 5.0


class _Figures:
    """Each spot deployment's last (asked, serving, stand-ins) and the doomed pods already counted, summed
    into the operator's gauges (no per-deployment label: see metrics.SPOT_REPLICAS)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_deployment: dict[str, tuple[int, int, int]] = {}
        self._doomed: dict[str, set[str]] = {}

    def record(self, key: str, cut: spot.Split, serving: int, doomed: Iterable[str]) -> None:
        with self._lock:
            self._by_deployment[key] = (cut.spot, min(serving, cut.spot), cut.fallback)
            now = set(doomed)
            metrics.SPOT_RECLAIMED.inc(len(now - self._doomed.get(key, set())))
            self._doomed[key] = now
            self._publish()

    def forget(self, key: str) -> None:
        with self._lock:
            self._by_deployment.pop(key, None)
            self._doomed.pop(key, None)
            self._publish()

    def _publish(self) -> None:
        for i, state in enumerate(("asked", "serving", "stand_in")):
            metrics.SPOT_REPLICAS.labels(state=state).set(sum(f[i] for f in self._by_deployment.values()))


FIGURES = _Figures()


@kopf.index("", "v1", "nodes")
def spot_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, spot.NodeView]:
    """Every node as the spot decisions see it (spot or not, being reclaimed or not)."""
    return {name: spot.node_view(body, POLICY.spot.node_labels, POLICY.spot.reclaim_taints)}


def _node_views(index: Mapping[str, Iterable[spot.NodeView]]) -> dict[str, spot.NodeView]:
    return {name: view for name, views in index.items() for view in list(views)[:1]}


def _by_name(deployments: Iterable[Mapping[str, Any]], name: str) -> dict[str, Any] | None:
    return next((dict(d) for d in deployments if (d.get("metadata") or {}).get("name") == name), None)


def _replicas(deployment: Mapping[str, Any] | None) -> int | None:
    return None if deployment is None else int((deployment.get("spec") or {}).get("replicas") or 0)


def autoscaler_view(deployments: Iterable[Mapping[str, Any]], name: str, spec: EmbeddingDeploymentSpec | None,
                    status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The runtime Deployment as the autoscaler reads it: without spot, the one Deployment; with spot, both
    as one, whose ``spec.replicas`` is the total the split was made for (not on-demand plus spot, which
    counts the stand-ins) and whose ready count is both sides'."""
    deployments = list(deployments)
    primary = _by_name(deployments, runtime_name(name))
    if spec is None or spec.spot is None or primary is None:
        return primary
    view = dict(spot.combined(primary, _by_name(deployments, spot.spot_name(runtime_name(name)))) or {})
    total = spot.recorded(status).get("total")
    if total is None:
        # Nothing recorded yet: the reconcile rendered every spot replica stood in for (on demand = total),
        # or without fallback the two sides adding up to it (render.spot_split).
        on_demand = _replicas(primary) or 0
        spot_side = _by_name(deployments, spot.spot_name(runtime_name(name)))
        total = on_demand if spec.spot.fallback == "onDemand" else on_demand + (_replicas(spot_side) or 0)
    view["spec"] = {**(view.get("spec") or {}), "replicas": max(0, int(total))}
    return view


def resize(name: str, namespace: str, body: Mapping[str, Any], spec: EmbeddingDeploymentSpec | None,
           total: int) -> None:
    """Set the runtime to ``total`` replicas: the one Deployment, or with spot both sides as `spot_split`
    divides it (the reconcile renders the same from the same status)."""
    if spec is None or spec.spot is None:
        KUBE.patch_merge("Deployment", runtime_name(name), namespace, {"spec": {"replicas": total}})
        return
    cut = spot_split(spec, total, spot.recorded(body.get("status")))
    KUBE.patch_merge("Deployment", runtime_name(name), namespace, {"spec": {"replicas": cut.on_demand}})
    KUBE.patch_merge("Deployment", spot.spot_name(runtime_name(name)), namespace, {"spec": {"replicas": cut.spot}})


def _evict(pod: str, namespace: str) -> bool:
    """The eviction API (PodDisruptionBudget respected; the pod drains through its preStop and grace);
    False when the pod is gone already or its PDB says not now (the next tick tries again)."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
    try:
        KUBE.request("POST", KUBE.kinds["Pod"].path(namespace, pod, "eviction"), body=body)
    except KubeError as exc:
        if exc.status not in (404, 429):
            raise
        return False
    return True


def _await_visible(live_spot: Callable[[], Any], wanted: Mapping[str, Any]) -> bool:
    deadline = time.monotonic() + STATUS_VISIBLE_WAIT_S
    while live_spot() != wanted:
        if time.monotonic() >= deadline:
            log.info("status.spot not in the watch after %.0fs; resizing anyway", STATUS_VISIBLE_WAIT_S)
            return False
        time.sleep(0.02)
    return True


def _autoscaler_total(spec: EmbeddingDeploymentSpec, status: Mapping[str, Any]) -> int:
    desired = (status.get("replicas") or {}).get("desired") if status.get("lastScaleDecision") else None
    return effective_replicas(spec, int(desired) if desired is not None else None)


def tick(name: str, namespace: str, body: Mapping[str, Any], spec: EmbeddingDeploymentSpec,
         stand_ins: spot.StandIns, nodes: Mapping[str, spot.NodeView], pods: Iterable[Mapping[str, Any]],
         deployments: Iterable[Mapping[str, Any]], now: float,
         live_spot: Callable[[], Any] | None = None) -> dict[str, Any] | None:
    """One round; returns the status.spot it wrote (None when nothing changed). ``live_spot`` reads
    status.spot from kopf's live view of the object: the Deployments are resized only once it shows the new
    split, since a reconcile renders their replicas from that view (a stale one would put them back; the
    autoscaler's `_apply` waits the same way)."""
    assert spec.spot is not None
    status = dict(body.get("status") or {})
    total = _autoscaler_total(spec, status)
    cap = spot.spot_cap(total, spec.spot.max)
    seen = spot.spot_pods(pods, nodes)
    missing = seen.missing(cap)  # spot replicas that cannot run; starting ones get no stand-in
    cut = spot.split(total, cap, stand_ins.observe(now, missing), spec.spot.fallback == "onDemand")
    reclaimed = sorted({f"{node}: {why}" for _, node, why in seen.doomed})
    wanted = {"total": cut.total, "spot": cut.spot, "onDemand": cut.on_demand, "serving": seen.serving,
              "fallback": cut.fallback, "reclaimed": reclaimed}
    recorded = spot.recorded(status)
    written = None
    if any(recorded.get(k) != v for k, v in wanted.items()):
        KUBE.patch_status(KIND, name, namespace, {"spot": wanted})
        written = wanted
        if live_spot is not None:
            _await_visible(live_spot, wanted)
    deployments = list(deployments)
    on_demand = _by_name(deployments, runtime_name(name))
    spot_side = _by_name(deployments, spot.spot_name(runtime_name(name)))
    if on_demand is not None and _replicas(on_demand) != cut.on_demand:
        KUBE.patch_merge("Deployment", runtime_name(name), namespace, {"spec": {"replicas": cut.on_demand}})
    if spot_side is not None and _replicas(spot_side) != cut.spot:
        KUBE.patch_merge("Deployment", spot.spot_name(runtime_name(name)), namespace,
                         {"spec": {"replicas": cut.spot}})
    before = int(recorded.get("fallback") or 0)
    if cut.fallback > before:
        why = "; ".join(reclaimed) or "unschedulable, failed or disrupted"
        kopf.info(dict(body), reason="SpotFallback",
                  message=f"{missing} of {cap} spot replicas cannot run ({why}): {cut.fallback} on-demand "
                          f"stand-ins, {cut.on_demand} on-demand replicas in all"[:1000])
    elif cut.fallback < before and recorded:
        kopf.info(dict(body), reason="SpotReturned",
                  message=f"{seen.serving} of {cap} spot replicas serving: {cut.fallback} on-demand stand-ins "
                          f"remain, {cut.on_demand} on-demand replicas in all")
    FIGURES.record(f"{namespace}/{name}", cut, seen.serving, (pod for pod, _, _ in seen.doomed))
    ready = int(((on_demand or {}).get("status") or {}).get("readyReplicas") or 0)
    # One eviction a tick: the PodDisruptionBudget allows one pod down at a time, so a second in the same
    # tick would only be refused (429); the next tick sees the first one terminating and goes on.
    for pod in spot.to_drain(seen.doomed, ready, cut.on_demand)[:1]:
        log.info("%s/%s: evicting spot pod %s before its node goes", namespace, name, pod)
        if _evict(pod, namespace):
            metrics.SPOT_EVICTIONS.inc()
    return written


def _live_spot(body: Mapping[str, Any]) -> Any:
    spot_status = (body.get("status") or {}).get("spot")
    return dict(spot_status) if isinstance(spot_status, Mapping) else spot_status


@kopf.daemon(*RESOURCE, cancellation_timeout=10.0)
async def spot_capacity(stopped: kopf.DaemonStopped, name: str, namespace: str, body: kopf.Body,
                        logger: kopf.Logger, spot_nodes: kopf.Index, runtime_pods: kopf.Index,
                        runtime_deployments: kopf.Index, **_: Any) -> None:
    """Runs for as long as the EmbeddingDeployment exists; idle (one in-memory check every few seconds)
    while it has no ``spec.spot``."""
    try:
        await _loop(stopped, name, namespace, body, logger, spot_nodes, runtime_pods, runtime_deployments)
    finally:
        FIGURES.forget(f"{namespace}/{name}")


async def _loop(stopped: kopf.DaemonStopped, name: str, namespace: str, body: kopf.Body, logger: kopf.Logger,
                spot_nodes: kopf.Index, runtime_pods: kopf.Index, runtime_deployments: kopf.Index) -> None:
    stand_ins: spot.StandIns | None = None
    while not stopped:
        parsed, _ = check(name, dict(body.get("spec") or {}))
        if parsed is None or parsed.spot is None:
            if stand_ins is not None:
                FIGURES.forget(f"{namespace}/{name}")
            stand_ins = None
            if parsed is not None and spot.recorded(body.get("status")):
                # spec.spot removed: the reconcile deleted <name>-spot; the split it recorded goes too.
                try:
                    await asyncio.to_thread(KUBE.patch_status, KIND, name, namespace, {"spot": None})
                except (KubeError, kubernetes.client.ApiException, OSError) as exc:
                    logger.warning("clearing status.spot failed, retrying: %s", exc)
            await asyncio.sleep(IDLE_RECHECK_S)
            continue
        if stand_ins is None or stand_ins.return_after != parsed.spot.return_after_seconds:
            stand_ins = spot.StandIns(parsed.spot.return_after_seconds)
        try:
            await asyncio.to_thread(
                tick, name, namespace, dict(body), parsed, stand_ins, _node_views(spot_nodes),
                list(runtime_pods.get((namespace, name), [])), list(runtime_deployments.get((namespace, name), [])),
                time.monotonic(), lambda: _live_spot(body))
        except (KubeError, kubernetes.client.ApiException, OSError) as exc:
            logger.warning("spot tick failed, retrying: %s", exc)
        await asyncio.sleep(TICK_S)
