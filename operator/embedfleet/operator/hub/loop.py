"""One scheduling round of the hub, and the thread that repeats it every interval.

A round: read every FleetCluster's heartbeat lease on its spoke (through the kubeconfig Secret) and update
its health, cached models and platform policy (the spoke's allow-lists: a deployment they forbid is not
placed there, and when it is short of replicas for that reason ``Placed=False`` names the spokes and
why); list, once per spoke, the copies the hub manages there; read each hub EmbeddingDeployment,
compute fleet-wide targets, call the pure ``place()``, then bring each spoke's copy to its share and write
the hub object's status. Everything is re-derived each round from what the API servers show plus an
in-memory health table, so a restarted hub resumes where the last one stopped (previous shares come from
``status.clusters``).

Idle rounds write nothing: a copy is written only when the live one does not already cover what the hub
wants (``Kube.apply``), a status only when a value changed (``convert.status_changes``), and no field
holds a per-round timestamp (``lastHeartbeat`` is recorded when a cluster's health changes, not at every
heartbeat: the spoke's Lease is the heartbeat). What could not be written shows in status (the row's
problem, ``Placed=False``/``Degraded=True`` naming the cluster and the error) and as an Event, once.

On a spoke the hub calls only (see docs/hub.md, "Identity on a spoke"): ``get`` its heartbeat Lease;
``list`` EmbeddingDeployments (all namespaces, by the hub-managed label); ``create``, ``patch`` and
``delete`` EmbeddingDeployments.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes
import urllib3
import yaml
from pydantic import ValidationError

from embedfleet.operator import status as st
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import (
    FLEET_CLUSTER_KIND,
    PLACEMENT_POLICY_KIND,
    FleetClusterSpec,
    PlacementPolicySpec,
)
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.autoscale import fleet_target
from embedfleet.operator.hub.health import Health, observe
from embedfleet.operator.kube import KINDS, Kube, KubeError
from embedfleet.operator.platform import PlatformPolicy
from embedfleet.operator.scheduling import Cluster, Deployment, Placement, place
from embedfleet.operator.scheduling.spill import spill_targets
from embedfleet.operator.spoke.heartbeat import (
    CACHED_ANNOTATION,
    LEASE_NAME,
    POLICY_ANNOTATION,
    PROBLEM_ANNOTATION,
)
from embedfleet.operator.validate import check

log = logging.getLogger(__name__)

ED = naming.EMBEDDING_DEPLOYMENT_KIND
ED_PATH = f"/apis/{naming.API_VERSION}/{naming.EMBEDDING_DEPLOYMENT_PLURAL}"  # all namespaces
ENV_INTERVAL = "EMBEDFLEET_HUB_INTERVAL"
ENV_RAMP = "EMBEDFLEET_HUB_RAMP_SECONDS"
#: Spoke requests retry a dropped connection once (an API server restart), no more: a round must not
#: stall on a spoke that is down.
SPOKE_RETRIES = 1
SPOKE_ERRORS = (KubeError, OSError, urllib3.exceptions.HTTPError, kubernetes.config.ConfigException,
                ValueError, yaml.YAMLError)


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _wall() -> str:
    return _stamp(datetime.now(UTC))


def _age(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (datetime.now(UTC) - parsed).total_seconds()


def describe(exc: BaseException) -> str:
    """A short, stable sentence for an error from a spoke (the same failure reads the same every round, so
    status does not change, and no Event repeats, because of an object address in a message)."""
    if isinstance(exc, KubeError):
        try:
            message = json.loads(exc.body).get("message") or exc.body
        except (ValueError, AttributeError):
            message = exc.body
        text = f"HTTP {exc.status} {exc.reason}: {message}"
        if exc.status == 409 and "already exists" in str(message):
            text += " (not created by the hub: remove or rename it on the spoke)"
    elif isinstance(exc, urllib3.exceptions.MaxRetryError):
        text = f"API server unreachable: {exc.reason}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return re.sub(r"<[^<>]* object at 0x[0-9a-f]+>:?\s*", "", text)[:400]


def _list_all(kube: Kube, path: str, selector: str | None = None) -> list[dict[str, Any]]:
    query = [("labelSelector", selector)] if selector else None
    data = kube._request("GET", path, query=query)
    return list((data or {}).get("items") or [])


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


def _condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any]:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}


@dataclass
class SpokeLink:
    kube: Kube
    fingerprint: str


@dataclass
class SpokeView:
    """One FleetCluster as this round sees it."""

    name: str
    region: str
    cluster: Cluster
    health: Health
    link: SpokeLink | None
    error: str | None  # why the spoke could not be read this round
    last_seen: str | None
    copies: dict[str, dict[str, Any]] | None = None  # hub-managed copies by namespace/name; None: not listed
    #: The spoke's platform allow-lists (the key is ``cluster.platform_policy``); a sentence when unreadable.
    policy: PlatformPolicy | str = field(default_factory=PlatformPolicy)
    gateway_url: str | None = None  # FleetCluster spec.gatewayUrl: where other clusters' gateways spill to


@dataclass
class HubState:
    health: dict[str, Health] = field(default_factory=dict)
    links: dict[str, SpokeLink] = field(default_factory=dict)
    seen: dict[str, tuple[float, str]] = field(default_factory=dict)  # (monotonic, wall) of the last renewal seen
    #: The platform policy annotation each spoke last published: kept over a round that cannot read the
    #: lease, so a spoke in its grace period is not judged by other rules (and its shares do not flap).
    policies: dict[str, str | None] = field(default_factory=dict)


class HubLoop:
    def __init__(self, hub: Kube | None = None, interval: float | None = None, ramp: float | None = None) -> None:
        self.hub = hub or Kube()
        self.interval = interval if interval is not None else float(os.environ.get(ENV_INTERVAL, "10"))
        self.ramp = ramp if ramp is not None else float(os.environ.get(ENV_RAMP, "60"))
        self.state = HubState()
        self.stop = threading.Event()

    # ------------------------------------------------------------ spokes

    def _link(self, name: str, spec: FleetClusterSpec) -> SpokeLink:
        ref = spec.connection.kubeconfig_secret
        secret = self.hub.get("Secret", ref.name, ref.namespace)
        if secret is None or ref.key not in (secret.get("data") or {}):
            raise ValueError(f"Secret {ref.namespace}/{ref.name} has no key {ref.key}")
        raw = base64.b64decode(secret["data"][ref.key])
        fingerprint = hashlib.sha256(raw).hexdigest()
        link = self.state.links.get(name)
        if link is None or link.fingerprint != fingerprint:
            config = kubernetes.client.Configuration()
            kubernetes.config.load_kube_config_from_dict(yaml.safe_load(raw), client_configuration=config)
            config.retries = SPOKE_RETRIES
            link = SpokeLink(Kube(kubernetes.client.ApiClient(configuration=config)), fingerprint)
            self.state.links[name] = link
        return link

    def _observe_cluster(self, fc: dict[str, Any], now: float) -> SpokeView | None:
        name = fc["metadata"]["name"]
        live_status = fc.get("status") or {}
        try:
            spec = FleetClusterSpec.model_validate(fc.get("spec") or {})
        except ValidationError as exc:
            cond = st.condition("Joined", False, "InvalidSpec", str(exc)[:1000])
            self._write_cluster_status(fc, {"conditions": st.merge_conditions(
                live_status.get("conditions"), [cond], _wall())})
            return None
        link: SpokeLink | None = None
        renew: str | None = None
        cached: list[str] = []
        problem: str | None = None
        error: str | None = None
        published = self.state.policies.get(name)
        lease_read = False
        try:
            link = self._link(name, spec)
            lease = link.kube.get("Lease", LEASE_NAME, spec.connection.namespace)
            lease_read = True
            annotations = ((lease or {}).get("metadata") or {}).get("annotations") or {}
            if lease is not None:
                renew = (lease.get("spec") or {}).get("renewTime")
                cached = [c for c in (annotations.get(CACHED_ANNOTATION) or "").split(",") if c]
                problem = annotations.get(PROBLEM_ANNOTATION) or None
            published = self.state.policies[name] = annotations.get(POLICY_ANNOTATION)
        except SPOKE_ERRORS as exc:
            error = describe(exc)
        policy_key, policy = convert.read_policy(published)
        if isinstance(policy, str):  # nothing is placed there until it can be read: say why, on the FleetCluster
            problem = f"{problem}; {policy}" if problem else policy
        if not lease_read:  # unknown this round: keep what the spoke last reported
            cached = list(live_status.get("cachedModels") or [])
        previous = self.state.health.get(name, Health())
        health = observe(previous, renew, now, spec.lease.duration_seconds, spec.lease.grace_seconds,
                         first_sight_age=_age(renew))
        self.state.health[name] = health

        # Times are recorded when the health changes, never per heartbeat (that would be a write per beat).
        was = _condition(live_status, "Available")
        steady = was.get("reason") == health.reason and was.get("status") == ("True" if health.available
                                                                                else "False")
        if steady:
            last_seen, renew_time = live_status.get("lastHeartbeat"), live_status.get("renewTime")
        else:
            last_seen, renew_time = self._seen_at(name, health, now), health.renew_time
        if not health.available:
            since = None
        elif was.get("status") == "True" and live_status.get("availableSince"):
            since = live_status.get("availableSince")
        else:
            since = _wall()

        where = f"lease {spec.connection.namespace}/{LEASE_NAME}"
        message = f"{where}: {error}" if error else (
            f"{where}: {health.reason}" if renew else f"{where}: not found (is the spoke operator running?)")
        conds = [
            st.condition("Joined", health.joined, "HeartbeatSeen" if health.joined else "NeverSeen", message),
            st.condition("Available", health.available, health.reason, message),
        ]
        if lease_read and renew:  # what the heartbeat says about itself; unknown while it cannot be read
            conds.append(st.condition("Degraded", bool(problem), "HeartbeatIncomplete" if problem else "Healthy",
                                      f"spoke heartbeat: {problem}" if problem else ""))
        self._write_cluster_status(fc, {
            "conditions": st.merge_conditions(live_status.get("conditions"), conds, _wall()),
            "lastHeartbeat": last_seen,
            "renewTime": renew_time,
            "availableSince": since,
            "cachedModels": sorted(cached),
            "allocatable": spec.capacity.model_dump(by_alias=True),
        })
        cluster = convert.cluster_from(name, spec, health, cached, policy_key)
        return SpokeView(name, spec.region, cluster, health, link, error, last_seen, policy=policy,
                         gateway_url=spec.gateway_url)

    def _seen_at(self, name: str, health: Health, now: float) -> str | None:
        """The hub's wall time of the renewal ``health`` last saw (kept, so it reads the same each time)."""
        if health.last_heartbeat is None:
            return None
        mono, wall = self.state.seen.get(name, (None, ""))
        if mono != health.last_heartbeat:
            wall = _stamp(datetime.now(UTC) - timedelta(seconds=max(0.0, now - health.last_heartbeat)))
            self.state.seen[name] = (health.last_heartbeat, wall)
        return wall

    def _write_cluster_status(self, fc: dict[str, Any], wanted: dict[str, Any]) -> None:
        changes = convert.status_changes(fc.get("status"), wanted)
        if changes:
            self.hub.patch_status(FLEET_CLUSTER_KIND, fc["metadata"]["name"], None, changes)

    def _list_copies(self, view: SpokeView) -> None:
        """The copies this hub manages on an available spoke: one list per spoke per round."""
        if view.link is None or view.error is not None or not view.health.available:
            return
        try:
            items = _list_all(view.link.kube, ED_PATH, f"{convert.HUB_MANAGED_LABEL}={view.name}")
        except SPOKE_ERRORS as exc:
            view.error = describe(exc)
            return
        view.copies = {_key(item): item for item in items
                       if ((item.get("metadata") or {}).get("labels") or {}).get(convert.HUB_MANAGED_LABEL)
                       == view.name}

    # ------------------------------------------------------------ one round

    def run_round(self) -> None:
        now = time.monotonic()
        views: dict[str, SpokeView] = {}
        for fc in _list_all(self.hub, KINDS[FLEET_CLUSTER_KIND].path()):
            view = self._observe_cluster(fc, now)
            if view is not None:
                views[view.name] = view
        for view in views.values():
            self._list_copies(view)
        policies = []
        for pp in _list_all(self.hub, KINDS[PLACEMENT_POLICY_KIND].path()):
            try:
                spec = PlacementPolicySpec.model_validate(pp.get("spec") or {})
            except ValidationError as exc:
                log.warning("PlacementPolicy %s ignored: %s", pp["metadata"]["name"], exc)
                continue
            policies.append(convert.policy_from(pp["metadata"]["name"], spec))

        # Each distinct spoke policy once; every deployment is checked against each of them once per round.
        spoke_policies = {v.cluster.platform_policy: v.policy for v in views.values()}
        hub_objects = _list_all(self.hub, ED_PATH)
        deployments: list[Deployment] = []
        info: dict[str, tuple[dict[str, Any], int]] = {}
        ns_labels: dict[str, dict[str, str]] = {}
        for obj in hub_objects:
            meta = obj["metadata"]
            key = _key(obj)
            parsed, problems = check(meta["name"], dict(obj.get("spec") or {}))
            if parsed is None:
                conds = [st.condition("Accepted", False, "InvalidSpec", "; ".join(problems), meta.get("generation"))]
                self._write_status(obj, {"observedGeneration": meta.get("generation"), "conditions": conds})
                continue
            copies = {v.name: v.copies[key] for v in views.values() if v.copies and key in v.copies}
            reports = [float(c["status"]["inFlight"]) for c in copies.values()
                       if (c.get("status") or {}).get("inFlight") is not None]
            status = obj.get("status") or {}
            target = fleet_target(parsed, sum(reports) if reports else None, status.get("targetReplicas"))
            previous = {r["name"]: int(r.get("desired") or 0) for r in status.get("clusters") or []}
            # What runs now, as the spokes report it: a spoke back from a partition keeps its serving pods.
            running = {c: int(((o.get("status") or {}).get("replicas") or {}).get("ready") or 0)
                       for c, o in copies.items()}
            if meta["namespace"] not in ns_labels:
                ns_labels[meta["namespace"]] = self._namespace_labels(meta["namespace"])
            refused = convert.refusals(obj.get("spec") or {}, spoke_policies)
            deployments.append(convert.deployment_from(key, parsed, ns_labels[meta["namespace"]], target, previous,
                                                       running, refused))
            info[key] = (obj, target)

        placements = place(deployments, [v.cluster for v in views.values()], policies, now, ramp_seconds=self.ramp)
        for key, placement in placements.items():
            obj, target = info[key]
            self._reconcile(obj, placement, target, views)
        self._collect_garbage(views, {_key(o) for o in hub_objects})

    def _reconcile(self, obj: dict[str, Any], placement: Placement, target: int,
                   views: Mapping[str, SpokeView]) -> None:
        """Bring every reachable spoke's copy to its share; write status and Events about what happened."""
        key = _key(obj)
        status = obj.get("status") or {}
        old_rows = {r["name"]: r for r in status.get("clusters") or []}
        rows: list[dict[str, Any]] = []
        failures: dict[str, str] = {}
        unavailable: dict[str, str] = {}
        gateways = {n: v.gateway_url for n, v in views.items() if v.gateway_url}
        for name, view in sorted(views.items()):
            share = placement.clusters.get(name) if placement.accepted else None
            if view.copies is not None:
                live = view.copies.get(key)
                problem = None
                try:
                    live = self._propagate(view, obj, share, live, spill_targets(placement, name, gateways))
                except SPOKE_ERRORS as exc:
                    problem = f"propagation failed: {describe(exc)}"
                if share is not None or live is not None or problem:
                    rows.append(convert.spoke_row(name, share, view.region, live, view.last_seen, problem))
                if problem:
                    failures[name] = problem
            elif view.health.available:  # in its grace period, but this round could not read it
                if share is not None or name in old_rows:
                    problem = f"unreachable: {view.error or 'not read this round'}"
                    rows.append(convert.spoke_row(name, share, view.region, None, view.last_seen, problem))
                    failures[name] = problem
            elif name in old_rows:  # it held a copy; its replicas moved, the copy there waits for its return
                problem = (f"unavailable ({view.health.reason}): replicas moved elsewhere; its copy there is "
                           "brought to its new share when it returns")
                rows.append(convert.spoke_row(name, None, view.region, None, view.last_seen, problem))
                unavailable[name] = view.health.reason
        self._events(obj, old_rows, rows, placement)
        wanted: dict[str, Any] = {
            "observedGeneration": obj["metadata"].get("generation"),
            "conditions": st.merge_conditions(
                status.get("conditions"),
                convert.conditions(placement, rows, failures, unavailable, obj["metadata"].get("generation")),
                _wall()),
        }
        ready = sum(int(r.get("ready") or 0) for r in rows if not convert.row_problem(r))
        inflight = [r["inflight"] for r in rows if r.get("inflight") is not None]
        wanted.update({
            "clusters": rows,
            "targetReplicas": target,
            "replicas": {"desired": placement.placed, "ready": ready,
                         "current": sum(int(r.get("desired") or 0) for r in rows)},
            "inFlight": sum(inflight) if inflight else None,
        })
        self._write_status(obj, wanted)

    def _propagate(self, view: SpokeView, obj: dict[str, Any], share: Any,
                   live: dict[str, Any] | None, spill: list[dict[str, str]] | None = None) -> dict[str, Any] | None:
        """Create, update or delete one spoke copy; no request at all when it already is what the hub wants."""
        assert view.link is not None
        meta = obj["metadata"]
        if live is not None and (live.get("metadata") or {}).get("deletionTimestamp"):
            return live  # still being deleted on the spoke (its operator's finalizer); created again after
        if share is None:
            if live is not None:
                view.link.kube.delete(ED, meta["name"], meta["namespace"])
                log.info("removed %s from %s (no longer placed there)", _key(obj), view.name)
            return None
        wanted = convert.spoke_manifest(obj, view.name, share, spill or [])
        result = view.link.kube.apply(wanted, live=live)
        if result == "unchanged":
            return live
        log.info("%s %s on %s: %s", result, _key(obj), view.name, share.range)
        return wanted if live is None else {**live, "spec": wanted["spec"],
                                            "metadata": {**live["metadata"], **wanted["metadata"]}}

    def _events(self, obj: dict[str, Any], old_rows: Mapping[str, Mapping[str, Any]], rows: list[dict[str, Any]],
                placement: Placement) -> None:
        """Events for what changed since the status the hub last wrote (so each is sent once, also across
        hub restarts): a cluster's problem appearing or clearing, and shares moving between clusters."""
        new_rows = {r["name"]: r for r in rows}
        for name in sorted(set(old_rows) | set(new_rows)):
            before, after = convert.row_problem(old_rows.get(name)), convert.row_problem(new_rows.get(name))
            if after and after != before:
                reason = {"propagation": "PropagationFailed", "unreachable": "ClusterUnreachable"}.get(
                    after.split(" ", 1)[0].rstrip(":"), "ClusterUnavailable")
                self._event(obj, reason, f"{name}: {after}", "Warning")
            elif before and not after and name in new_rows:
                self._event(obj, "Propagated", f"{name}: share in place again", "Normal")
        old = {n: int(r.get("desired") or 0) for n, r in old_rows.items() if int(r.get("desired") or 0)}
        new = placement.desired() if placement.accepted else {}
        if old and old != new:
            def fmt(shares: Mapping[str, int]) -> str:
                return ", ".join(f"{n}={k}" for n, k in sorted(shares.items())) or "none"

            self._event(obj, "Rescheduled", f"{fmt(old)} -> {fmt(new)}", "Normal")

    def _event(self, obj: dict[str, Any], reason: str, message: str, type_: str) -> None:
        try:
            self.hub.event({**obj, "apiVersion": naming.API_VERSION, "kind": ED}, reason, message, type_)
        except SPOKE_ERRORS as exc:
            log.warning("could not record event %s on %s: %s", reason, _key(obj), exc)
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s %s: %s", _key(obj), reason, message)

    def _write_status(self, obj: dict[str, Any], wanted: dict[str, Any]) -> None:
        changes = convert.status_changes(obj.get("status"), wanted)
        if changes:
            meta = obj["metadata"]
            self.hub.patch_status(ED, meta["name"], meta["namespace"], changes)
            log.info("status of %s: %s", _key(obj), json.dumps(changes, sort_keys=True)[:2000])

    def _namespace_labels(self, namespace: str) -> dict[str, str]:
        """For PlacementPolicy namespace selectors; an unreadable namespace matches only selector-less policies."""
        try:
            ns = self.hub.get("Namespace", namespace)
        except KubeError as exc:
            log.warning("reading namespace %s failed, treating it as unlabelled: %s", namespace, exc)
            return {}
        return dict(((ns or {}).get("metadata") or {}).get("labels") or {})

    def _collect_garbage(self, views: Mapping[str, SpokeView], keys: set[str]) -> None:
        """Spoke copies of hub objects that no longer exist on the hub."""
        for view in views.values():
            if view.copies is None or view.link is None:
                continue
            for key, item in view.copies.items():
                meta = item["metadata"]
                if key in keys or meta.get("deletionTimestamp"):
                    continue
                try:
                    view.link.kube.delete(ED, meta["name"], meta["namespace"])
                    log.info("removed orphan %s from %s", key, view.name)
                except SPOKE_ERRORS as exc:
                    log.warning("removing orphan %s from %s failed: %s", key, view.name, describe(exc))

    # ------------------------------------------------------------ thread

    def run_forever(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.run_round()
            except Exception:  # one bad round (API hiccup) must not stop scheduling for good
                log.exception("hub scheduling round failed; retrying next interval")
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
