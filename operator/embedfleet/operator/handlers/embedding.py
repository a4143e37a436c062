"""kopf handlers for EmbeddingDeployment: converge the live objects to ``render(spec)``, and the status to
what is live. Nothing else.

Two kinds of trigger, one path (`converge`):
- the EmbeddingDeployment itself is created, changed or found at start-up (``resume``);
- an object it owns (Deployment, Service, ConfigMap, PDB) is changed or deleted,
  by a person or a controller: the watch on that kind brings the event, the owner is re-read and
  converged. A hand edit of the image or a deleted Service is reverted within one reconcile; a
  Deployment's pods becoming ready update ``Available`` as it happens (no polling timer).

Revisions (docs/rollouts.md): each converge first runs the rollout decision (rollout/revisions.py) on the
recorded status, the deployment's pods and, while a candidate is gated, the revisions' probes read from
their pods (rollout/probe_client.py); render then runs the current revision as the primary Deployment and
the others beside it. A revision Deployment's change converges the owner (its pods became ready: the gate
can read them), and a per-object daemon converges it while a gate or a promotion is in flight.

Every step is idempotent: the same spec renders the same manifests, `Kube.apply` compares against the
live object and writes only differences, and the status is written only when it differs, so a converge
of a deployment in steady state issues reads only. An invalid spec is reported in ``Accepted=False`` and
creates nothing; the handler returns normally so kopf does not retry a spec only a user can fix.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from embedfleet.operator import platform, spot
from embedfleet.operator import status as st
from embedfleet.operator.autoscale_target import DEPRECATION_REASON, of_parsed
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.handlers import cache_volumes
from embedfleet.operator.handlers.common import cache_nodes, reject
from embedfleet.operator.handlers.common import now as _now
from embedfleet.operator.kube import OWNED_KINDS, Kube, KubeError, NotOwned, up_to_date
from embedfleet.operator.render import effective_replicas, render, runtime_name, selector_string
from embedfleet.operator.render.cache_volumes import wanted_claims
from embedfleet.operator.rollout import probe_client
from embedfleet.operator.rollout.revisions import (
    Observed,
    Plan,
    Run,
    decide,
    needs_observation,
    poll_wanted,
    recorded_runs,
    rolled_revision,
)
from embedfleet.operator.runtime_tracing import runtime_tracing_env
from embedfleet.operator.validate import check

KUBE = Kube()
#: The chart's platform allow-lists (EMBEDFLEET_PLATFORM_POLICY) and default runtime image
#: (EMBEDFLEET_DEFAULT_RUNTIME_IMAGE), read once at start-up: a `helm upgrade` that changes the default restarts
#: the operator, whose start-up converge (``resume``) rolls every deployment that names no image.
POLICY = platform.load()
#: The chart's tracing values for runtime pods (EMBEDFLEET_RUNTIME_OTEL_*), read once at start-up.
RUNTIME_TRACING = runtime_tracing_env()
RESOURCE = (naming.GROUP, naming.VERSION, naming.EMBEDDING_DEPLOYMENT_PLURAL)
KIND = naming.EMBEDDING_DEPLOYMENT_KIND
#: Kinds whose changes re-converge their owner: (group, version, plural).
OWNED_WATCHES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("", "v1", "persistentvolumeclaims"),  # the node cache's claims (handlers/cache_volumes.py)
)
MANAGED = {naming.MANAGED_BY_LABEL: naming.MANAGED_BY}
#: Everything namespaced an EmbeddingDeployment may own, today's objects and the pre-pull DaemonSet and
#: ServiceAccount older operators rendered (deleted on the next converge). Cluster-scoped objects are not
#: looked for: older operators' ClusterRoleBindings point at a ClusterRole the chart no longer installs.
PRUNED_KINDS = tuple(kind for kind in OWNED_KINDS if kind != "ClusterRoleBinding")
#: Every object is also converged this often (reads only when nothing drifted), like controller-runtime's
#: resync period: self-healing stays bounded even if a watch goes silent (seen once after an API server
#: restart: a resumed stream that delivered nothing).
RESYNC_SECONDS = float(os.environ.get("EMBEDFLEET_RESYNC_SECONDS", "120"))
#: While a candidate is gated (or a promotion rolls), the owner is converged this often: a runtime that
#: kwok or a kubelet reports Ready may not answer its probe yet, and a gate timeout needs a clock.
GATE_POLL_SECONDS = float(os.environ.get("EMBEDFLEET_GATE_POLL_SECONDS", "5"))
#: Kinds a revision beside the primary renders: what a rollout transition prunes.
REVISION_KINDS = ("Service", "Deployment", "ConfigMap")


class _Locks:
    """One lock per EmbeddingDeployment: a spec event and an owned-object event never converge the same
    owner at once (they would race to create the same objects)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def __call__(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._locks.pop((namespace, name), None)


LOCKS = _Locks()
#: (namespace, name) -> monotonic time of the last converge (for the resync timer).
LAST_CONVERGED: dict[tuple[str, str], float] = {}


def _autoscaler_desired(status: Any) -> int | None:
    """The autoscaler's last decision, once it has made one (see operator/status.py for ownership)."""
    status = status or {}
    if not status.get("lastScaleDecision"):
        return None
    desired = (status.get("replicas") or {}).get("desired")
    return int(desired) if desired is not None else None


def wanted_status(
    name: str,
    namespace: str,
    spec: EmbeddingDeploymentSpec,
    status: Mapping[str, Any] | None,
    generation: int | None,
    desired: int,
    deployment: Mapping[str, Any] | None,
    plan: Plan | None = None,
) -> dict[str, Any]:
    """Status from the runtime Deployment (as read, or as a watch event just showed it) and, with
    pre-pull on, the node agents' cache labels on the Nodes. ``replicas.desired`` is written here only
    while autoscaling is off; with it on, the autoscaler is its one writer. ``plan`` (a converge's
    rollout decision) adds the revisions, currentRevision, queryVectorSpace, rollout and RolloutBlocked."""
    counts = None
    if spec.cache.pre_pull and spec.model.digest is not None:
        counts = cache_nodes(KUBE, namespace, spec.model.digest, spec.cache.node_selector, spec.cache.node_pools,
                             POLICY.allow_control_plane)
    observed, fields = st.observed_conditions(
        deployment=deployment,
        cache_nodes=counts,
        desired=desired,
        generation=generation,
        probe_drift=(status or {}).get("probeDrift"),
    )
    accepted = accepted_condition(spec, generation)
    replicas = fields.pop("replicas")
    if not spec.autoscaling.enabled:
        replicas["desired"] = desired
    if plan is not None:
        observed.append({**plan.blocked, "observedGeneration": generation} if generation is not None
                        else dict(plan.blocked))
        fields.update(plan.status_fields())
    conditions = st.merge_conditions((status or {}).get("conditions"), [accepted, *observed], _now())
    return {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": replicas,
        "selector": selector_string(name),
        **fields,
    }


def accepted_condition(spec: EmbeddingDeploymentSpec, generation: int | None) -> dict[str, Any]:
    """Accepted=True; reason Deprecated, its message naming the field, while the autoscaler's in-flight
    target borrows spec.runtime.maxBatchRequests (autoscale_target.py)."""
    deprecation = of_parsed(spec).deprecation
    if deprecation is None:
        return st.condition("Accepted", True, "Valid", "spec accepted", generation)
    return st.condition("Accepted", True, DEPRECATION_REASON, f"spec accepted; {deprecation}", generation)


def _accepted(conditions: Any) -> Mapping[str, Any]:
    return next((c for c in conditions or [] if c.get("type") == "Accepted"), {})


def announce_deprecation(obj: Mapping[str, Any], status: Mapping[str, Any], update: Mapping[str, Any]) -> None:
    """One Warning Event (reason Deprecated) when a status write makes the Accepted condition name a
    deprecation it did not name before; later writes of the same message add none."""
    new = _accepted(update.get("conditions"))
    if new.get("reason") != DEPRECATION_REASON:
        return
    old = _accepted(status.get("conditions"))
    if old.get("reason") == DEPRECATION_REASON and old.get("message") == new.get("message"):
        return
    message = str(new.get("message", "")).removeprefix("spec accepted; ")
    kopf.warn(dict(obj), reason=DEPRECATION_REASON, message=message[:1000])


def admit(obj: Mapping[str, Any]) -> tuple[EmbeddingDeploymentSpec | None, list[str]]:
    """The spec's own checks, the platform's allow-lists, and the one check that needs a read: a
    referenced Secret must carry the platform's label (only its metadata is fetched, never its data).

    The same allow-lists run earlier as the chart's ValidatingAdmissionPolicy; this is the check that
    holds when that policy is absent (or the spec predates it). A Secret labelled later is picked up by
    the next resync.
    """
    meta = obj.get("metadata") or {}
    parsed, problems = check(meta["name"], dict(obj.get("spec") or {}), POLICY)
    if parsed is None:
        return parsed, problems
    refs = {"apiKeySecret": parsed.runtime.api_key_secret, "apiKeysSecret": parsed.runtime.api_keys_secret}
    for field, ref in refs.items():
        if ref is None:
            continue
        try:
            secret = KUBE.get_metadata("Secret", ref.name, meta["namespace"])
        except KubeError as exc:
            raise kopf.TemporaryError(f"cannot read Secret {ref.name!r}'s labels: {exc}", delay=30) from exc
        labels = None if secret is None else dict((secret.get("metadata") or {}).get("labels") or {})
        problems += platform.secret_problems(ref.name, meta["namespace"], labels, POLICY,
                                             where=f"spec.runtime.{field}")
    return (None if problems else parsed), problems


def _render(obj: Mapping[str, Any], parsed: EmbeddingDeploymentSpec,
            revisions: tuple[list[Run], str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(replicas to run, manifests) for a parsed, valid object; ``revisions`` are the runs and the query
    vector space (a converge's plan), else what status records."""
    meta = obj["metadata"]
    service_monitor = parsed.monitoring.service_monitor and KUBE.has_resource(
        "monitoring.coreos.com/v1", "servicemonitors"
    )
    autoscaler_desired = _autoscaler_desired(obj.get("status"))
    runs, query_space = revisions or recorded_runs(parsed, obj.get("status")) or (None, None)
    manifests = render(meta["name"], meta["namespace"], meta["uid"], parsed,
                       allow_control_plane=POLICY.allow_control_plane,
                       autoscaler_desired=autoscaler_desired, service_monitor_available=service_monitor,
                       platform_env=RUNTIME_TRACING, runs=runs, query_vector_space=query_space,
                       default_image=POLICY.runtime_image, spot_status=spot.recorded(obj.get("status")),
                       spot_rules=POLICY.spot)
    return effective_replicas(parsed, autoscaler_desired), manifests


#: (namespace, name) -> the rollout status fields this process last wrote: a converge whose in-memory
#: object says otherwise (a watch event not in yet) re-reads it, so no transition is decided twice.
LAST_ROLLOUT: dict[tuple[str, str], dict[str, Any]] = {}


def _fresh_status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj["metadata"]
    status = obj.get("status") or {}
    written = LAST_ROLLOUT.get((meta["namespace"], meta["name"]))
    if written is None or all(status.get(k) == v for k, v in written.items()):
        return status
    live = KUBE.get(KIND, meta["name"], meta["namespace"])
    return (live or {}).get("status") or status


def plan_rollout(obj: Mapping[str, Any], parsed: EmbeddingDeploymentSpec, status: Mapping[str, Any]) -> Plan:
    """The rollout decision (rollout/revisions.py) from what is live: the deployment's pods and, when the
    decision asks for them, the revisions' probes read from their pods. In steady state nothing is read."""
    meta = obj["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    annotations = meta.get("annotations") or {}
    hub_revision = annotations.get(naming.REVISION_ANNOTATION)
    hub_space = annotations.get(naming.VECTOR_SPACE_ANNOTATION)
    now = datetime.now(UTC)
    if not needs_observation(parsed, status, hub_revision):
        return decide(name, parsed, status, Observed(now, primary_revision=status.get("currentRevision")),
                      hub_revision=hub_revision, hub_vector_space=hub_space)
    pods = KUBE.list("Pod", namespace, {naming.INSTANCE_LABEL: name})
    observed = Observed(now, ready=probe_client.ready_by_revision(pods),
                        primary_revision=rolled_revision(KUBE.get("Deployment", runtime_name(name), namespace)))
    plan = decide(name, parsed, status, observed, hub_revision=hub_revision, hub_vector_space=hub_space)
    if not plan.probe_wanted:
        return plan
    served = parsed.model.served_model_name or name
    probes = {rev: probe_client.read_probe(probe_client.revision_ips(pods, rev), parsed.runtime.port, served)
              for rev in plan.probe_wanted}
    return decide(name, parsed, status, Observed(now, observed.ready, observed.primary_revision, probes),
                  hub_revision=hub_revision, hub_vector_space=hub_space)


def _announce(obj: Mapping[str, Any], plan: Plan, logger: Any) -> None:
    for event in plan.events:
        logger.info("%s: %s", event.reason, event.message)
        if event.type == "Warning":
            kopf.warn(dict(obj), reason=event.reason, message=event.message[:1000])
        else:
            kopf.info(dict(obj), reason=event.reason, message=event.message[:1000])


def converge(
    obj: Mapping[str, Any], logger: Any, *, prune: bool, patch: kopf.Patch | None = None
) -> None:
    """Make every owned object match ``render(spec)`` and the status match what is live.

    ``patch`` is kopf's patch when called from a handler of the object itself; it carries only the
    rejection of an invalid spec (which no other writer races). Status is merge-patched directly, only
    when it differs.
    """
    meta = obj.get("metadata") or {}
    name, namespace = meta["name"], meta["namespace"]
    if meta.get("deletionTimestamp"):
        return
    status = obj.get("status") or {}
    generation = meta.get("generation")
    parsed, problems = admit(obj)
    if parsed is None:
        if patch is not None:
            reject(obj, patch, status, problems, generation, logger)
        return
    uid = meta.get("uid")
    if not uid:
        raise kopf.TemporaryError("metadata.uid is not set yet; owner references need it", delay=5)
    LAST_CONVERGED[(namespace, name)] = time.monotonic()
    with LOCKS(namespace, name):
        status = _fresh_status(obj)
        plan = plan_rollout(obj, parsed, status)
        # A rollout transition (a revision started, promoted, blocked, retired) removes the objects of
        # revisions that stopped running; in steady state nothing is listed.
        transition = any(status.get(k) != v for k, v in plan.status_fields().items())
        desired, manifests = _render({**obj, "status": status}, parsed,
                                     (plan.runs, plan.query_vector_space))
        claims = wanted_claims(namespace, manifests)
        try:
            # The node cache's claims and volumes first: the pods that mount them can start at once.
            results = cache_volumes.ensure(KUBE, name, uid, claims, POLICY.cache_root)
            results.update({f"{m['kind']}/{m['metadata']['name']}": KUBE.apply(m) for m in manifests})
            kinds = PRUNED_KINDS if prune else REVISION_KINDS if transition else ()
            pruned = KUBE.prune(KIND, name, uid, namespace, manifests, kinds=kinds) if kinds else []
            if prune or transition:
                pruned += cache_volumes.release(KUBE, namespace, uid, claims)
        except NotOwned as exc:
            _report_conflict(obj, status, generation, str(exc))
            return
        except KubeError as exc:
            if 400 <= exc.status < 500 and exc.status not in (404, 409, 429):
                message = f"the API server refused a rendered object: {exc}"
                kopf.warn(dict(obj), reason="ApplyFailed", message=message[:1000])
                raise kopf.TemporaryError(message, delay=30) from exc
            raise kopf.TemporaryError(str(exc), delay=10) from exc
        changed = {key: result for key, result in results.items() if result != "unchanged"}
        if changed or pruned:
            summary = ", ".join(f"{result} {key}" for key, result in changed.items())
            if pruned:
                summary += (", " if summary else "") + "deleted " + ", ".join(pruned)
            logger.info("converged: %s", summary)
            kopf.info(dict(obj), reason="Applied", message=summary[:1000])
        # Written here, directly, never through kopf's patch: kopf applies its patch later with a
        # resourceVersion precondition and retries it when that fails, so a stale status from this
        # handler could land after (and undo) a newer one written by an owned-object event.
        deployment = _observed(name, namespace, parsed)
        wanted = wanted_status(name, namespace, parsed, status, generation, desired, deployment, plan)
        update = st.status_patch(status, wanted)
        if update:
            KUBE.patch_status(KIND, name, namespace, update)
            announce_deprecation(obj, status, update)
        LAST_ROLLOUT[(namespace, name)] = plan.status_fields()
        if transition:
            _announce(obj, plan, logger)


def _report_conflict(obj: Mapping[str, Any], status: Mapping[str, Any], generation: int | None,
                     message: str) -> None:
    """Someone else's object is in the way: say so (Degraded, an Event) and write nothing else. Objects
    created before the conflict was met stay; a spec or name change, or the object's removal, resolves it."""
    degraded = st.condition("Degraded", True, "NotOwned", message, generation)
    conditions = st.merge_conditions(status.get("conditions"), [degraded], _now())
    wanted = {"observedGeneration": generation, "conditions": conditions}
    update = st.status_patch(status, wanted)
    if not update:
        return
    kopf.warn(dict(obj), reason="NotOwned", message=message[:1000])
    meta = obj["metadata"]
    KUBE.patch_status(KIND, meta["name"], meta["namespace"], update)


@kopf.index(*RESOURCE)
def embedding_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    """The latest EmbeddingDeployment bodies in memory, so an owned-object event needs no read."""
    return {(namespace, name): dict(body)}


@kopf.on.create(*RESOURCE)
def created(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    converge(body, logger, prune=False, patch=patch)  # nothing of a new object can be stale yet


@kopf.on.resume(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    converge(body, logger, prune=True, patch=patch)


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(body: kopf.Body, name: str, namespace: str, logger: kopf.Logger, **_: Any) -> None:
    """Converge objects no event converged lately (a busy object's watches are evidently working; and
    hundreds of timers started together do not all hit the API server at once)."""
    if time.monotonic() - LAST_CONVERGED.get((namespace, name), float("-inf")) < RESYNC_SECONDS * 0.9:
        return
    converge(body, logger, prune=False)


def _owner(obj: Mapping[str, Any]) -> str | None:
    """Name of the EmbeddingDeployment that controls ``obj``, if one does."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{naming.GROUP}/"):
            return ref.get("name")
    return None


def owned_changed(body: kopf.Body, event: Mapping[str, Any], namespace: str, logger: kopf.Logger,
                  embedding_index: kopf.Index, **_: Any) -> None:
    """An owned object changed or vanished.

    Cheap in the common case (our own writes coming back, a Deployment's status moving): the owner comes
    from the in-memory index, only this object is compared with what the owner renders, and only a
    Deployment or DaemonSet event refreshes the owner's status (from a fresh read of the Deployment). A
    drifted or deleted object converges the owner in full.
    """
    owner_name = _owner(body)
    if owner_name is None or not namespace:
        return
    owner = next(iter(embedding_index.get((namespace, owner_name), [])), None)
    if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
        return  # gone or going; garbage collection removes what it owned
    refs = (body.get("metadata") or {}).get("ownerReferences") or []
    if not any(r.get("uid") == owner["metadata"].get("uid") for r in refs):
        return  # a leftover of an older object of the same name
    parsed, _ = admit(owner)
    if parsed is None:
        return
    desired, manifests = _render(owner, parsed)
    kind, name = body.get("kind"), (body.get("metadata") or {}).get("name")
    wanted = next((m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name), None)
    if event.get("type") == "DELETED" or (wanted is not None and not up_to_date(body, wanted)):
        converge(owner, logger, prune=False)
        return
    if kind not in ("Deployment", "DaemonSet"):
        return
    serving = (runtime_name(owner_name), spot.spot_name(runtime_name(owner_name)))
    if kind == "Deployment" and (name not in serving or _rollout_moving(owner.get("status"))):
        # A candidate's or side revision's pods became ready (the gate reads them now), or the primary
        # rolled on during a promotion (the old revision retires once it has).
        converge(owner, logger, prune=False)
        return
    with LOCKS(namespace, owner_name):
        # The owner as this process last wrote it (the index may not have our last write yet: conditions
        # computed from an older list would drop one, RolloutBlocked say).
        status = _fresh_status(owner)
        # Read, not the event's body: an event can be older than what a converge just read and wrote,
        # and status from it would flap (ready 1 -> 0 -> 1).
        observed = _observed(owner_name, namespace, parsed)
        update = st.status_patch(status, wanted_status(owner_name, namespace, parsed, status,
                                                       owner["metadata"].get("generation"), desired, observed))
        if update:
            KUBE.patch_status(KIND, owner_name, namespace, update)
            announce_deprecation(owner, status, update)


def _observed(name: str, namespace: str, parsed: EmbeddingDeploymentSpec) -> Any:
    """The runtime Deployment as status reads it: with spot, both sides as one (`spot.combined`)."""
    deployment = KUBE.get("Deployment", runtime_name(name), namespace)
    if parsed.spot is None:
        return deployment
    return spot.combined(deployment, KUBE.get("Deployment", spot.spot_name(runtime_name(name)), namespace))


def refresh_status(name: str, namespace: str) -> None:
    """Re-derive one EmbeddingDeployment's status from a fresh read of it and of its Deployment.

    For the daemon that writes a status field the conditions fold in (``status.probeDrift``): kopf runs
    no update handler for a status change, and conditions have one writer, this module's code, under the
    owner's lock. Writes only what differs."""
    with LOCKS(namespace, name):
        owner = KUBE.get(KIND, name, namespace)
        if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
            return
        parsed, _ = admit(owner)
        if parsed is None:
            return
        status = owner.get("status") or {}
        desired = effective_replicas(parsed, _autoscaler_desired(status))
        observed = _observed(name, namespace, parsed)
        update = st.status_patch(status, wanted_status(name, namespace, parsed, status,
                                                       owner["metadata"].get("generation"), desired, observed))
        if update:
            KUBE.patch_status(KIND, name, namespace, update)
            announce_deprecation(owner, status, update)


for _group, _version, _plural in OWNED_WATCHES:
    kopf.on.event(_group, _version, _plural, labels=MANAGED, id=f"owned-{_plural}")(owned_changed)


def _rollout_moving(status: Mapping[str, Any] | None) -> bool:
    """A rollout waits on the primary Deployment: a promotion draining the old revision."""
    return any(r.get("state") == "Draining" for r in (status or {}).get("revisions") or [])


@kopf.daemon(*RESOURCE, cancellation_timeout=10.0)
async def gate_poll(stopped: kopf.DaemonStopped, body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """Converge while a candidate is gated, a promotion rolls or a side revision's fingerprint is unread:
    probes that did not answer yet are read again, and a gate that runs out of time blocks.

    A daemon, not a timer: an idle deployment costs a look at its status in memory every interval, on
    the event loop, with no worker thread and no log line (sixty idle deployments with a timer each kept
    the executor and the log busy)."""
    while not stopped:
        # A plain sleep: kopf cancels an async daemon when it stops it, and `stopped.wait(n)` can leave a
        # timed-out task behind that kopf re-raises on exit (see autoscale_daemon.wait_for_tick).
        await asyncio.sleep(GATE_POLL_SECONDS)
        if stopped:
            return
        spec = body.get("spec") or {}
        timeout = float((spec.get("rollout") or {}).get("gateTimeoutSeconds") or 600)
        if poll_wanted(body.get("status"), datetime.now(UTC), timeout):
            try:
                await asyncio.to_thread(converge, body, logger, prune=False)
            except (kopf.TemporaryError, KubeError, OSError) as exc:
                logger.warning("gate poll: converge failed, retrying next interval: %s", exc)


@kopf.on.delete(*RESOURCE)
def cleanup(meta: kopf.Meta, name: str, namespace: str, logger: kopf.Logger, **_: Any) -> None:
    """Owner references let the cluster's garbage collector do this; deleting explicitly makes the
    objects go before the EmbeddingDeployment does (its finalizer), not some time after."""
    with LOCKS(namespace, name):
        deleted = KUBE.prune(KIND, name, meta.get("uid"), namespace, keep=[], kinds=PRUNED_KINDS)
        deleted += cache_volumes.release(KUBE, namespace, meta.get("uid"), keep=[])
    LOCKS.forget(namespace, name)
    LAST_CONVERGED.pop((namespace, name), None)
    LAST_ROLLOUT.pop((namespace, name), None)
    if deleted:
        logger.info("deleted %s", ", ".join(deleted))


@kopf.on.event("", "v1", "persistentvolumes", labels=cache_volumes.SELECTOR)
def cache_volume_changed(body: kopf.Body, event: Mapping[str, Any], logger: kopf.Logger, **_: Any) -> None:
    """One of the node cache's volumes changed (or is listed at start-up): deleted once its claim is gone."""
    if event.get("type") != "DELETED" and cache_volumes.sweep(KUBE, body, POLICY.cache_root):
        logger.info("deleted PersistentVolume %s: its claim is gone", body["metadata"]["name"])
