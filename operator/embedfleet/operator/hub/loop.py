"""The hub's scheduling round, and the thread that repeats it every interval (sooner when an intent changes).

What a round reads comes from informers (informer.py), never from a request per object: on the hub, the
FleetClusters, PlacementPolicies, EmbeddingDeployments and Namespaces; on each spoke, the copies this hub
manages there and the spoke's heartbeat Lease. A fleet's reads therefore cost one watch per collection and
one event per change, whatever its size.

A round: judge each spoke's health from its Lease as the watch last showed it (and its credentials: a
kubeconfig that is broken, expired or refused is ``CredentialsValid=False`` on the FleetCluster and freezes
that spoke's last known health, so it does not fail over everything it runs); compute fleet-wide targets and
call the pure ``place()``; plan, per spoke, the writes that bring its copies (and the namespaces and
API-key Secrets they need) to what the hub wants; run each spoke's writes on that spoke's own thread with
a time-out, all spokes at once; then write the hub objects' status. A spoke whose writes are still running,
whose circuit breaker is open (breaker.py) or whose watch has not yet shown the hub's last writes is
skipped: its status rows stay as they were, and only it waits.

Idle rounds write nothing: a copy is written only when the live one does not already cover what the hub
wants (``kube.up_to_date``), a status only when a value changed (``convert.status_changes``), and no field
holds a per-round timestamp. What could not be written shows in status (the row's problem,
``Placed=False``/``Degraded=True`` naming the cluster and the error) and as an Event, once.

On a spoke the hub calls only (see the chart's hub-access.yaml): ``list``/``watch`` EmbeddingDeployments
(all namespaces, by the hub-managed label) and ``create``/``patch``/``delete`` them; ``get``/``list``/
``watch`` its heartbeat Lease; ``get``/``create`` Namespaces; and, where the spoke's chart allows it and
the deployment's PlacementPolicy says ``propagateSecrets``, ``get``/``create``/``patch`` the referenced
Secret.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from embedfleet.operator import metrics
from embedfleet.operator import status as st
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import (
    FLEET_CLUSTER_KIND,
    PLACEMENT_POLICY_KIND,
    FleetClusterSpec,
    PlacementPolicySpec,
)
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.autoscale import fleet_target
from embedfleet.operator.hub.breaker import Breaker
from embedfleet.operator.hub.credentials import CredentialPolicy, spoke_client
from embedfleet.operator.hub.errors import SPOKE_ERRORS, credential_problem, describe
from embedfleet.operator.hub.health import Health, observe
from embedfleet.operator.hub.informer import Informer, object_key, version_at_least
from embedfleet.operator.hub.policy_status import policy_statuses
from embedfleet.operator.hub.propagate import Needs, needs_of, secret_copy
from embedfleet.operator.kube import Kube, KubeError, up_to_date
from embedfleet.operator.platform import PlatformPolicy
from embedfleet.operator.rollout import waves
from embedfleet.operator.scheduling import Cluster, ClusterPlacement, Deployment, Placement, place
from embedfleet.operator.scheduling.spill import spill_targets
from embedfleet.operator.spoke import gateway_load
from embedfleet.operator.spoke.heartbeat import (
    CACHED_ANNOTATION,
    GATEWAY_LOAD_ANNOTATION,
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
ENV_WRITE_TIMEOUT = "EMBEDFLEET_HUB_WRITE_TIMEOUT"
ENV_CREDENTIALS_RECHECK = "EMBEDFLEET_HUB_CREDENTIALS_RECHECK"
ENV_SECRET_RECHECK = "EMBEDFLEET_HUB_SECRET_RECHECK"
#: Spoke requests retry a dropped connection once (an API server restart), no more: the breaker decides.
SPOKE_RETRIES = 1
#: How often the hub re-reads a spoke's kubeconfig Secret (a rotated credential is picked up; the
#: default, overridden by EMBEDFLEET_HUB_CREDENTIALS_RECHECK), and, while the spoke refuses the credential,
#: how soon it looks again.
CREDENTIALS_RECHECK_S = 60.0
CREDENTIALS_RETRY_S = 5.0
#: A round waits this long at most for the spokes' write batches before it writes status; a batch still
#: running then is reported in a later round (it delays only its own spoke).
ROUND_WAIT_S = 2.0
#: How often the hub compares a propagated Secret with its own (one get on the hub): a rotated API key
#: reaches the spokes within this time (the default; EMBEDFLEET_HUB_SECRET_RECHECK overrides it).
SECRET_RECHECK_S = 300.0
#: How often a write a spoke refused (4xx) is tried again while what the hub wants is unchanged.
REFUSAL_RETRY_S = 30.0
#: How long a round waits, in all, for the first lists of spokes it has just connected to.
LINK_WAIT_S = 2.0
#: An intent change wakes the loop early, but rounds start at most this often.
MIN_GAP_S = 0.2


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _wall() -> str:
    return _stamp(datetime.now(UTC))


def _wall_stamp(seconds: float) -> str:
    return _stamp(datetime.fromtimestamp(seconds, UTC))


def _parse_wall(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _age(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (datetime.now(UTC) - parsed).total_seconds()


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


def _ready(copy: Mapping[str, Any] | None) -> int:
    """Ready replicas a spoke's copy reports (0: no copy, no status yet, or being deleted)."""
    if copy is None or (copy.get("metadata") or {}).get("deletionTimestamp"):
        return 0
    replicas = ((copy.get("status") or {}).get("replicas") or {})
    try:
        return int(replicas.get("ready") or 0)
    except (TypeError, ValueError):
        return 0


def _condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any]:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}


def _fingerprint(manifest: Mapping[str, Any] | None) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest() if manifest else ""


def _version(obj: Mapping[str, Any] | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


@dataclass
class SpokeLink:
    """The hub's connection to one spoke: its client, its two informers and its own writer thread."""

    name: str
    kube: Kube
    fingerprint: str
    copies: Informer
    lease: Informer
    checked: float  # monotonic time the kubeconfig Secret was last read
    writer: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spoke-writer"))
    batch: concurrent.futures.Future[dict[str, Outcome]] | None = None
    written: str = ""  # the newest resourceVersion the spoke returned for the hub's writes
    breaker: Breaker = field(default_factory=Breaker)
    namespaces: set[str] = field(default_factory=set)  # known to exist there
    #: namespace/name -> (fingerprint last written, monotonic time the hub's Secret was last compared)
    secrets: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: Copies whose last write has an unknown outcome (timed out, connection lost, 5xx): the spoke may have
    #: done it. The next attempt reads the object first, so a hung spoke that comes back is not sent the
    #: same create twice.
    unsure: set[str] = field(default_factory=set)
    #: Writes the spoke refused (4xx: its RBAC, a same-named object it owns): key -> (when, the problem,
    #: the manifest refused). Tried again after REFUSAL_RETRY_S or as soon as the wanted copy changes, so a
    #: refusal costs one request per retry period, not one per round, and its problem stays in status.
    refused: dict[str, tuple[float, str, str]] = field(default_factory=dict)

    def busy(self) -> bool:
        return self.batch is not None and not self.batch.done()

    def close(self) -> None:
        self.copies.stop(timeout=0.1)
        self.lease.stop(timeout=0.1)
        self.writer.shutdown(wait=False, cancel_futures=True)


@dataclass
class SpokeView:
    """One FleetCluster as this round sees it."""

    name: str
    region: str
    cluster: Cluster
    health: Health
    link: SpokeLink | None
    error: str | None  # why the spoke could not be read
    last_seen: str | None
    copies: dict[str, dict[str, Any]] | None = None  # hub-managed copies by namespace/name; None: unknown
    #: The spoke's platform allow-lists (the key is ``cluster.platform_policy``); a sentence when unreadable.
    policy: PlatformPolicy | str = field(default_factory=PlatformPolicy)
    gateway_url: str | None = None  # FleetCluster spec.gatewayUrl: where other clusters' gateways spill to
    #: Skipped this round (writes running, breaker open, or its watch not yet showing the hub's writes):
    #: its status rows are carried over. The sentence says why when it is a problem (breaker open).
    held: str | None = None
    skipped: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)  # the FleetCluster's (rollout waves select on them)


@dataclass(frozen=True)
class Write:
    """One planned change on a spoke, run on that spoke's writer thread."""

    key: str  # namespace/name of the hub object
    share: ClusterPlacement | None
    manifest: dict[str, Any] | None  # the copy to apply; None: delete the copy
    live: dict[str, Any] | None
    needs: Needs


@dataclass(frozen=True)
class Outcome:
    live: dict[str, Any] | None
    problem: str | None = None


@dataclass
class HubState:
    health: dict[str, Health] = field(default_factory=dict)
    links: dict[str, SpokeLink] = field(default_factory=dict)
    seen: dict[str, tuple[float, str]] = field(default_factory=dict)  # (monotonic, wall) of the last renewal seen
    #: The platform policy annotation each spoke last published: kept while its lease cannot be read, so a
    #: spoke in its grace period is not judged by other rules (and its shares do not flap).
    policies: dict[str, str | None] = field(default_factory=dict)
    #: Spokes whose credentials failed: cluster -> (reason, sentence).
    credentials: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Rollout soak clocks: hub object -> (revision, wave, wall time the wave was first seen healthy).
    soak: dict[str, tuple[str, int, float]] = field(default_factory=dict)


class HubLoop:
    def __init__(self, hub: Kube | None = None, interval: float | None = None, ramp: float | None = None,
                 write_timeout: float | None = None) -> None:
        self.hub = hub or Kube()
        self.interval = interval if interval is not None else float(os.environ.get(ENV_INTERVAL, "10"))
        self.ramp = ramp if ramp is not None else float(os.environ.get(ENV_RAMP, "60"))
        self.write_timeout = (write_timeout if write_timeout is not None
                              else float(os.environ.get(ENV_WRITE_TIMEOUT, "10")))
        self.credentials_recheck = float(os.environ.get(ENV_CREDENTIALS_RECHECK, CREDENTIALS_RECHECK_S))
        self.secret_recheck = float(os.environ.get(ENV_SECRET_RECHECK, SECRET_RECHECK_S))
        self.credential_policy = CredentialPolicy.from_env()
        self.state = HubState()
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.informers: dict[str, Informer] = {}
        self._busy = threading.Lock()  # a round and a standby's warm-up never run at once

    # ------------------------------------------------------------ informers

    def _hub_informers(self) -> dict[str, Informer]:
        """The hub's own collections, watched; started on the first round."""
        if not self.informers:
            def wake(_: str) -> None:
                self.wake.set()

            kinds = self.hub.kinds
            paths = {"clusters": kinds[FLEET_CLUSTER_KIND].path(), "policies": kinds[PLACEMENT_POLICY_KIND].path(),
                     "deployments": ED_PATH, "namespaces": kinds["Namespace"].path()}
            watched = {"clusters": FLEET_CLUSTER_KIND, "policies": PLACEMENT_POLICY_KIND,
                       "deployments": naming.EMBEDDING_DEPLOYMENT_KIND, "namespaces": "Namespace"}
            self.informers = {name: Informer(self.hub, path, name=f"hub-{name}", kind=watched[name],
                                             on_change=None if name == "namespaces" else wake).start()
                              for name, path in paths.items()}
        return self.informers

    def warm(self) -> None:
        """Open every watch a round needs without running one (a standby's caches; writes nothing)."""
        with self._busy:
            informers = self._hub_informers()
            if all(inf.wait_synced(30) for inf in informers.values()):
                self._links(self._specs(informers["clusters"].items(), report=False), time.monotonic())

    def close(self) -> None:
        for informer in self.informers.values():
            informer.stop(timeout=0.1)
        for link in self.state.links.values():
            link.close()

    # ------------------------------------------------------------ spokes

    def _spoke_client(self, raw: bytes) -> Kube:
        kube, _ = spoke_client(raw, self.credential_policy, timeout=(5.0, self.write_timeout),
                               retries=SPOKE_RETRIES)
        return kube

    def _link(self, name: str, spec: FleetClusterSpec, now: float) -> SpokeLink:
        """The spoke's link; its kubeconfig Secret is read again every CREDENTIALS_RECHECK_S (sooner while
        the spoke refuses it), and a changed one replaces the link and its informers."""
        link = self.state.links.get(name)
        due = min(CREDENTIALS_RETRY_S, self.credentials_recheck) if name in self.state.credentials \
            else self.credentials_recheck
        if link is not None and now - link.checked < due:
            return link
        ref = spec.connection.kubeconfig_secret
        secret = self.hub.get("Secret", ref.name, ref.namespace)
        if secret is None or ref.key not in (secret.get("data") or {}):
            raise ValueError(f"kubeconfig Secret {ref.namespace}/{ref.name} has no key {ref.key}")
        raw = base64.b64decode(secret["data"][ref.key])
        fingerprint = hashlib.sha256(raw).hexdigest()
        if link is not None and link.fingerprint == fingerprint:
            link.checked = now
            return link
        kube = self._spoke_client(raw)
        lease_ns = spec.connection.namespace
        copies = Informer(kube, ED_PATH, name=f"{name}-copies", kind=naming.EMBEDDING_DEPLOYMENT_KIND,
                          label_selector=f"{convert.HUB_MANAGED_LABEL}={name}")
        lease = Informer(kube, kube.kinds["Lease"].path(lease_ns), name=f"{name}-lease", kind="Lease",
                         field_selector=f"metadata.name={LEASE_NAME}")
        new = SpokeLink(name, kube, fingerprint, copies.start(), lease.start(), now)
        if link is not None:
            new.breaker, new.namespaces, new.secrets, new.unsure = (link.breaker, link.namespaces, link.secrets,
                                                                    link.unsure)
            link.close()
        self.state.links[name] = new
        return new

    def _links(self, specs: Mapping[str, FleetClusterSpec], now: float) -> dict[str, SpokeLink | BaseException]:
        """Every FleetCluster's link (or why there is none). New links list concurrently and get one short
        shared wait, so a hub starting on a hundred spokes does not wait for them one by one."""
        out: dict[str, SpokeLink | BaseException] = {}
        fresh: list[SpokeLink] = []
        for name, spec in specs.items():
            known = self.state.links.get(name)
            try:
                out[name] = link = self._link(name, spec, now)
            except SPOKE_ERRORS as exc:
                out[name] = exc
                continue
            if link is not known:
                fresh.append(link)
        deadline = time.monotonic() + LINK_WAIT_S
        for link in fresh:
            for informer in (link.lease, link.copies):
                informer.wait_synced(max(0.0, deadline - time.monotonic()))
        return out

    def _specs(self, clusters: Mapping[str, dict[str, Any]], report: bool = True) -> dict[str, FleetClusterSpec]:
        """The FleetClusters' specs, parsed once per round; an invalid one is left out, and reported on it
        unless ``report`` is off (a standby writes nothing)."""
        specs = {}
        for name, fc in clusters.items():
            try:
                specs[name] = FleetClusterSpec.model_validate(fc.get("spec") or {})
            except ValidationError as exc:
                if not report:
                    continue
                live_status = fc.get("status") or {}
                cond = st.condition("Joined", False, "InvalidSpec", str(exc)[:1000])
                self._write_cluster_status(fc, {"conditions": st.merge_conditions(
                    live_status.get("conditions"), [cond], _wall())})
        return specs

    def _observe_cluster(self, fc: dict[str, Any], spec: FleetClusterSpec, now: float,
                         connected: SpokeLink | BaseException | None) -> SpokeView:
        name = fc["metadata"]["name"]
        live_status = fc.get("status") or {}
        link: SpokeLink | None = None
        renew: str | None = None
        cached: list[str] = []
        problem: str | None = None
        load: dict[str, int] | None = None
        error: str | None = None
        credentials: tuple[str, str] | None = None
        published = self.state.policies.get(name)
        lease_read = False
        if isinstance(connected, SpokeLink):
            link = connected
        elif connected is not None:
            error = describe(connected)
            credentials = (credential_problem(connected) or "InvalidKubeconfig", error)
        if link is not None:
            failure = link.lease.exception or link.copies.exception
            if failure is not None:
                error = describe(failure)
                reason = credential_problem(failure)
                if reason:
                    credentials = (reason, error)
            elif link.lease.synced:
                lease_read = True
                lease = next(iter(link.lease.items().values()), None)
                annotations = ((lease or {}).get("metadata") or {}).get("annotations") or {}
                if lease is not None:
                    renew = (lease.get("spec") or {}).get("renewTime")
                    cached = [c for c in (annotations.get(CACHED_ANNOTATION) or "").split(",") if c]
                    problem = annotations.get(PROBLEM_ANNOTATION) or None
                    load = gateway_load.parse_annotation(annotations.get(GATEWAY_LOAD_ANNOTATION))
                published = self.state.policies[name] = annotations.get(POLICY_ANNOTATION)
            else:
                error = "not listed yet"
        if credentials is not None:
            if name not in self.state.credentials:
                log.warning("spoke %s: credentials refused (%s): %s; keeping its last known health",
                            name, credentials[0], credentials[1])
            self.state.credentials[name] = credentials
        else:
            self.state.credentials.pop(name, None)
        policy_key, policy = convert.read_policy(published)
        if isinstance(policy, str):  # nothing is placed there until it can be read: say why, on the FleetCluster
            problem = f"{problem}; {policy}" if problem else policy
        if not lease_read:  # unknown this round: keep what the spoke last reported
            cached = list(live_status.get("cachedModels") or [])
            load = gateway_load.from_mapping(live_status.get("gateway"))
        previous = self.state.health.get(name, Health())
        if credentials is not None:
            # The hub cannot see the spoke, which says nothing about whether it runs: keep what was known
            # (a spoke never seen stays unplaced), rather than fail over everything it serves.
            health = previous
        else:
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
        if credentials is not None:
            message = f"{where}: cannot be read with the kubeconfig: {error}; health as last known ({health.reason})"
        elif error:
            message = f"{where}: {error}"
        else:
            message = f"{where}: {health.reason}" if renew else f"{where}: not found (is the spoke operator running?)"
        conds = [
            st.condition("Joined", health.joined, "HeartbeatSeen" if health.joined else "NeverSeen", message),
            st.condition("Available", health.available, health.reason, message),
            st.condition("CredentialsValid", credentials is None,
                         credentials[0] if credentials else "Accepted",
                         f"the spoke refuses the hub's kubeconfig ({spec.connection.kubeconfig_secret.namespace}/"
                         f"{spec.connection.kubeconfig_secret.name}): {credentials[1]}" if credentials
                         else "the spoke accepts the hub's kubeconfig"),
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
            # written only when a number changes: an idle fleet's stay 0, and status stays unwritten
            "gateway": gateway_load.cluster_status(spec.gateway_url, load),
        })
        cluster = convert.cluster_from(name, spec, health, cached, policy_key)
        view = SpokeView(name, spec.region, cluster, health, link, error, last_seen, policy=policy,
                         gateway_url=spec.gateway_url, labels=dict(fc["metadata"].get("labels") or {}))
        self._copies_of(view, now)
        return view

    def _copies_of(self, view: SpokeView, now: float) -> None:
        """The copies on an available spoke as its watch shows them, or why this round leaves it alone."""
        link = view.link
        if link is None or view.error is not None or not view.health.available:
            return
        if link.busy():
            view.skipped = True  # its last writes still run: only this spoke waits
            return
        if not link.breaker.allows(now):
            view.skipped = True
            view.held = (f"writes paused after {link.breaker.failures} failed attempts "
                         f"({link.breaker.last_error}); next try in {link.breaker.open_until - now:.0f}s")
            return
        if not link.copies.synced or not link.copies.caught_up(link.written):
            view.skipped = True  # the watch has not shown the hub's last writes yet: judge it next round
            return
        view.copies = link.copies.items()

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
            self._patch_status("clusters", FLEET_CLUSTER_KIND, fc, changes)

    def _forget(self, names: Iterable[str]) -> None:
        """FleetClusters that were deleted: their links and informers stop."""
        for name in list(names):
            link = self.state.links.pop(name, None)
            if link is not None:
                link.close()
            try:
                metrics.BREAKER_OPEN.remove(name)
            except KeyError:  # never exported
                pass
            for table in (self.state.health, self.state.seen, self.state.policies, self.state.credentials):
                table.pop(name, None)

    # ------------------------------------------------------------ one round

    def run_round(self) -> None:
        with self._busy:
            self._round()

    def _round(self) -> None:
        informers = self._hub_informers()
        if not all(inf.wait_synced(30) for inf in informers.values()):
            log.warning("hub informers not synced yet; round skipped")
            return
        now = time.monotonic()
        views: dict[str, SpokeView] = {}
        clusters = informers["clusters"].items()
        self._forget(set(self.state.links) - set(clusters))
        specs = self._specs(clusters)
        links = self._links(specs, now)
        for name, link in self.state.links.items():
            metrics.BREAKER_OPEN.labels(cluster=name).set(1 if link.breaker.is_open(now) else 0)
        for name, spec in specs.items():
            views[name] = self._observe_cluster(clusters[name], spec, now, links.get(name))
        policies, policy_specs = [], {}
        for pp in informers["policies"].items().values():
            try:
                spec = PlacementPolicySpec.model_validate(pp.get("spec") or {})
            except ValidationError as exc:
                log.warning("PlacementPolicy %s ignored: %s", pp["metadata"]["name"], exc)
                continue
            policies.append(convert.policy_from(pp["metadata"]["name"], spec))
            policy_specs[pp["metadata"]["name"]] = spec

        # Each distinct spoke policy once; every deployment is checked against each of them once per round.
        spoke_policies = {v.cluster.platform_policy: v.policy for v in views.values()}
        namespaces = informers["namespaces"].items()
        hub_objects = list(informers["deployments"].items().values())
        deployments: list[Deployment] = []
        info: dict[str, tuple[dict[str, Any], int]] = {}
        parsed_specs: dict[str, EmbeddingDeploymentSpec] = {}
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
            labels = dict(((namespaces.get(meta["namespace"]) or {}).get("metadata") or {}).get("labels") or {})
            refused = convert.refusals(obj.get("spec") or {}, spoke_policies)
            deployments.append(convert.deployment_from(key, parsed, labels, target, previous, running, refused))
            info[key] = (obj, target)
            parsed_specs[key] = parsed

        placements = place(deployments, [v.cluster for v in views.values()], policies, now, ramp_seconds=self.ramp)
        self._write_policy_statuses(informers["policies"].items(), placements)
        plans: dict[str, list[Write]] = {name: [] for name in views}
        decisions = {key: self._rollout(info[key][0], parsed_specs[key], placement, views)
                     for key, placement in placements.items()}
        self.state.soak = {k: v for k, v in self.state.soak.items() if k in decisions}
        for key, placement in placements.items():
            obj, _ = info[key]
            spec = policy_specs.get(placement.policy or "")
            self._plan(obj, placement, views, plans, spec.propagate_secrets if spec else False,
                       decisions[key].pins)
        for view in views.values():
            if view.copies is not None:
                plans[view.name] += self._orphans(view, set(info) | {_key(o) for o in hub_objects})
        outcomes = self._run_writes(views, plans)
        for key, placement in placements.items():
            obj, target = info[key]
            self._reconcile(obj, placement, target, views, outcomes, decisions[key])

    # ------------------------------------------------------------ planning and writing

    def _rollout(self, obj: dict[str, Any], spec: EmbeddingDeploymentSpec, placement: Placement,
                 views: Mapping[str, SpokeView]) -> waves.Decision:
        """This round's rollout decision (rollout/waves.py) from the copies as each spoke's watch last
        showed them (a spoke skipped this round still reports), with the soak clock this hub keeps."""
        key = _key(obj)
        shares = placement.clusters if placement.accepted else {}
        members = {n: waves.Member(views[n].region, views[n].labels) for n in shares if n in views}
        copies: dict[str, Any] = {}
        for name in members:
            link = views[name].link
            if link is not None and link.copies.synced:
                copies[name] = link.copies.items().get(key)
        status = obj.get("status") or {}
        recorded = status.get("rollout") or {}
        soak = self.state.soak.get(key)
        since = soak[2] if soak and (soak[0], soak[1]) == (recorded.get("revision"), recorded.get("wave") or 0) \
            else None
        decision = waves.decide(status, spec, members, copies, time.time(), since, _wall_stamp, _parse_wall)
        rollout = decision.rollout
        if rollout.healthy_since is not None:
            self.state.soak[key] = (rollout.new, rollout.wave, rollout.healthy_since)
        else:
            self.state.soak.pop(key, None)
        return decision

    def _plan(self, obj: dict[str, Any], placement: Placement, views: Mapping[str, SpokeView],
              plans: dict[str, list[Write]], propagate_secrets: bool,
              pins: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """The writes that bring each judged spoke's copy of ``obj`` to its share (none when it already is)."""
        key = _key(obj)
        gateways = {n: v.gateway_url for n, v in views.items() if v.gateway_url}
        ready = {n: _ready(v.copies.get(key)) for n, v in views.items() if v.copies is not None}
        for name, view in views.items():
            if view.copies is None:
                continue
            live = view.copies.get(key)
            if live is not None and (live.get("metadata") or {}).get("deletionTimestamp"):
                continue  # still being deleted on the spoke (its operator's finalizer); created again after
            share = placement.clusters.get(name) if placement.accepted else None
            if share is None:
                if view.link is not None:
                    view.link.refused.pop(key, None)
                if live is not None:
                    plans[name].append(Write(key, None, None, live, Needs(key.split("/", 1)[0])))
                continue
            manifest = convert.spoke_manifest(obj, name, share, spill_targets(placement, name, gateways, ready),
                                              (pins or {}).get(name))
            needs = needs_of(obj, propagate_secrets)
            assert view.link is not None
            now = time.monotonic()
            stale_secret = any(ref not in view.link.secrets
                               or now - view.link.secrets[ref][1] >= self.secret_recheck for ref in needs.secrets)
            refused = view.link.refused.get(key)
            if refused is not None and refused[2] == _fingerprint(manifest) and \
                    time.monotonic() - refused[0] < REFUSAL_RETRY_S:
                continue  # refused a moment ago, and nothing changed: its problem stays in status
            if live is None or not up_to_date(live, manifest) or stale_secret or key in view.link.unsure:
                plans[name].append(Write(key, share, manifest, live, needs))

    def _orphans(self, view: SpokeView, keys: set[str]) -> list[Write]:
        """Deletions of spoke copies whose hub object no longer exists."""
        assert view.copies is not None
        return [Write(key, None, None, item, Needs(key.split("/", 1)[0])) for key, item in view.copies.items()
                if key not in keys and not (item.get("metadata") or {}).get("deletionTimestamp")]

    def _run_writes(self, views: Mapping[str, SpokeView],
                    plans: Mapping[str, list[Write]]) -> dict[str, dict[str, Outcome]]:
        """Each spoke's writes on its own thread, all spokes at once; waits ROUND_WAIT_S at most. A spoke
        whose batch is still running afterwards is reported by a later round (``skipped`` until then)."""
        started: dict[str, concurrent.futures.Future[dict[str, Outcome]]] = {}
        for name, writes in plans.items():
            link = views[name].link
            if writes and link is not None:
                metrics.HUB_WRITES_QUEUED.inc(len(writes))
                link.batch = link.writer.submit(self._timed_batch, link, writes, time.monotonic())
                started[name] = link.batch
        if started:
            concurrent.futures.wait(started.values(), timeout=ROUND_WAIT_S)
        outcomes: dict[str, dict[str, Outcome]] = {}
        for name, future in started.items():
            if future.done():
                outcomes[name] = future.result()
            else:
                views[name].skipped = True
        return outcomes

    def _timed_batch(self, link: SpokeLink, writes: list[Write], queued_at: float) -> dict[str, Outcome]:
        """``_write_batch`` counted in the write queue's metrics (depth, and time from hand-over to done)."""
        try:
            return self._write_batch(link, writes)
        finally:
            metrics.HUB_WRITES_QUEUED.dec(len(writes))
            metrics.HUB_WRITE_BATCH_SECONDS.observe(time.monotonic() - queued_at)

    def _write_batch(self, link: SpokeLink, writes: list[Write]) -> dict[str, Outcome]:
        """Runs on the spoke's writer thread. A failure of the spoke itself (unreachable, time-out, 5xx)
        stops the batch and counts against the spoke's breaker; a refusal of one object (4xx) is that
        object's problem."""
        outcomes: dict[str, Outcome] = {}
        for write in writes:
            try:
                outcomes[write.key] = Outcome(self._write(link, write))
            except SPOKE_ERRORS as exc:
                problem = f"propagation failed: {describe(exc)}"
                outcomes[write.key] = Outcome(write.live, problem)
                if isinstance(exc, KubeError) and 400 <= exc.status < 500:
                    link.refused[write.key] = (time.monotonic(), problem, _fingerprint(write.manifest))
                else:
                    link.unsure.add(write.key)
                    link.breaker = link.breaker.failed(time.monotonic(), describe(exc))
                    for rest in writes[writes.index(write) + 1:]:
                        outcomes[rest.key] = Outcome(rest.live, problem)
                    return outcomes
        for key, outcome in outcomes.items():
            if outcome.problem is None:
                link.refused.pop(key, None)
        link.breaker = link.breaker.succeeded()
        return outcomes

    def _write(self, link: SpokeLink, write: Write) -> dict[str, Any] | None:
        kube, namespace = link.kube, write.needs.namespace
        unsure = write.key in link.unsure
        if write.manifest is None:
            assert write.live is not None
            meta = write.live["metadata"]
            answer = kube.delete_object(ED, meta["name"], meta["namespace"])
            if answer is not None and answer.get("kind") == ED:  # held by the spoke operator's finalizer
                self._note_version(link, answer)
            log.info("removed %s from %s", write.key, link.name)
            link.unsure.discard(write.key)
            return None
        if namespace not in link.namespaces:
            if kube.get("Namespace", namespace) is None:
                kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
                    "name": namespace, "labels": {convert.HUB_MANAGED_LABEL: link.name}}})
                log.info("created namespace %s on %s", namespace, link.name)
            link.namespaces.add(namespace)
        for ref in write.needs.secrets:
            self._propagate_secret(link, ref)
        try:
            if unsure:  # the last attempt may have landed: look before writing again
                result, live = kube.apply_object(write.manifest)
            else:
                result, live = kube.apply_object(write.manifest, live=write.live)
        except KubeError as exc:
            if exc.status == 404 and write.live is None:
                link.namespaces.discard(namespace)  # deleted on the spoke since: create it next round
            raise
        log.info("%s %s on %s: %s", result, write.key, link.name, write.share.range if write.share else "-")
        link.unsure.discard(write.key)
        self._note_version(link, live)
        return live

    def _propagate_secret(self, link: SpokeLink, ref: str) -> None:
        """Copy the hub's Secret ``namespace/name`` to the spoke (only its data and type; labelled as the
        hub's), when its content differs from what the hub last wrote there."""
        namespace, name = ref.split("/", 1)
        source = self.hub.get("Secret", name, namespace)
        if source is None:
            raise KubeError(404, "Not Found", json.dumps({"message": f"Secret {ref} does not exist on the hub"}),
                            f"copy Secret {ref}")
        manifest, fingerprint = secret_copy(source, link.name)
        if link.secrets.get(ref, ("", 0.0))[0] == fingerprint:
            link.secrets[ref] = (fingerprint, time.monotonic())
            return
        live = link.kube.get("Secret", name, namespace)
        if live is not None and ((live.get("metadata") or {}).get("labels") or {}).get(
                convert.HUB_MANAGED_LABEL) != link.name:
            raise KubeError(409, "Conflict", json.dumps({"message": f"Secret {ref} exists on the spoke and was "
                                                         "not written by the hub: it is left alone"}),
                            f"copy Secret {ref}")
        # Never through apply(): its last-applied annotation would hold the Secret's data in clear.
        if live is None:
            link.kube.create(manifest)
        else:
            link.kube.patch_merge("Secret", name, namespace, {"metadata": {"labels": manifest["metadata"]["labels"]},
                                                              "data": manifest["data"]})
        link.secrets[ref] = (fingerprint, time.monotonic())
        log.info("copied Secret %s to %s", ref, link.name)

    @staticmethod
    def _note_version(link: SpokeLink, live: Mapping[str, Any] | None) -> None:
        """Remember the newest version the hub's writes produced: the spoke is judged again only once its
        watch shows it (so the next round does not write the same change twice)."""
        version = _version(live)
        if version and (not link.written or not version_at_least(link.written, version)):
            link.written = version

    # ------------------------------------------------------------ status

    def _reconcile(self, obj: dict[str, Any], placement: Placement, target: int,
                   views: Mapping[str, SpokeView], outcomes: Mapping[str, Mapping[str, Outcome]],
                   decision: waves.Decision | None = None) -> None:
        """Status and Events of one hub object from what each spoke's copy is after this round's writes."""
        key = _key(obj)
        status = obj.get("status") or {}
        old_rows = {r["name"]: r for r in status.get("clusters") or []}
        rows: list[dict[str, Any]] = []
        failures: dict[str, str] = {}
        unavailable: dict[str, str] = {}
        for name, view in sorted(views.items()):
            share = placement.clusters.get(name) if placement.accepted else None
            if view.copies is not None and not view.skipped:
                outcome = outcomes.get(name, {}).get(key)
                refused = view.link.refused.get(key) if view.link is not None else None
                if outcome is None and refused is not None and share is not None:  # refused, not retried yet
                    outcome = Outcome(view.copies.get(key), refused[1])
                live = outcome.live if outcome is not None else view.copies.get(key)
                problem = outcome.problem if outcome is not None else convert.refusal_of(live)
                if share is not None or live is not None or problem:
                    rows.append(convert.spoke_row(name, share, view.region, live, view.last_seen, problem))
                if problem:
                    failures[name] = problem
            elif view.skipped and view.health.available:
                row = old_rows.get(name)
                if view.held:  # breaker open: say so
                    rows.append(convert.spoke_row(name, share, view.region, None, view.last_seen, view.held))
                    failures[name] = view.held
                elif row is not None:  # its writes are still running: the row as the hub last wrote it
                    rows.append(dict(row))
                    if convert.row_problem(row):
                        failures[name] = str(convert.row_problem(row))
                elif share is not None:  # a new share whose first write is still running there
                    rows.append(convert.spoke_row(name, share, view.region, None, view.last_seen))
            elif view.health.available:  # in its grace period, but its watch is down
                if share is not None or name in old_rows:
                    problem = f"unreachable: {view.error or 'not read yet'}"
                    rows.append(convert.spoke_row(name, share, view.region, None, view.last_seen, problem))
                    failures[name] = problem
            elif name in old_rows:  # it held a copy; its replicas moved, the copy there waits for its return
                problem = (f"unavailable ({view.health.reason}): replicas moved elsewhere; its copy there is "
                           "brought to its new share when it returns")
                rows.append(convert.spoke_row(name, None, view.region, None, view.last_seen, problem))
                unavailable[name] = view.health.reason
        self._events(obj, old_rows, rows, placement)
        generation = obj["metadata"].get("generation")
        conds = convert.conditions(placement, rows, failures, unavailable, generation)
        if decision is not None:
            self._rollout_events(obj, status.get("rollout") or {}, decision.status["rollout"])
            if decision.blocked is not None:
                conds.append(st.condition("RolloutBlocked", *decision.blocked, generation))
        wanted: dict[str, Any] = {
            "observedGeneration": generation,
            "conditions": st.merge_conditions(status.get("conditions"), conds, _wall()),
            **(decision.status if decision is not None else {}),
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

    def _rollout_events(self, obj: dict[str, Any], before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
        """An Event when a rollout's wave or phase changes (compared with the status last written: once)."""
        if (before.get("revision"), before.get("phase"), before.get("wave")) == \
                (after.get("revision"), after.get("phase"), after.get("wave")):
            return
        phase = after.get("phase")
        if phase == waves.ROLLED_BACK:
            self._event(obj, "RolledBack", str(after.get("message")), "Warning")
        elif phase in (waves.WAVES, waves.SIDE_BY_SIDE, waves.DONE):
            self._event(obj, "Rollout", str(after.get("message")), "Normal")

    def _write_policy_statuses(self, live: Mapping[str, dict[str, Any]], placements: Mapping[str, Placement]) -> None:
        for name, wanted in policy_statuses(live, placements).items():
            pp = live[name]
            status = pp.get("status") or {}
            wanted = {**wanted, "conditions": st.merge_conditions(status.get("conditions"), wanted["conditions"],
                                                                  _wall())}
            changes = convert.status_changes(status, wanted)
            if changes:
                self._patch_status("policies", PLACEMENT_POLICY_KIND, pp, changes)

    def _events(self, obj: dict[str, Any], old_rows: Mapping[str, Mapping[str, Any]], rows: list[dict[str, Any]],
                placement: Placement) -> None:
        """Events for what changed since the status the hub last wrote (so each is sent once, also across
        hub restarts): a cluster's problem appearing or clearing, and shares moving between clusters."""
        new_rows = {r["name"]: r for r in rows}
        for name in sorted(set(old_rows) | set(new_rows)):
            before, after = convert.row_problem(old_rows.get(name)), convert.row_problem(new_rows.get(name))
            if after and after != before:
                reason = {"propagation": "PropagationFailed", "unreachable": "ClusterUnreachable",
                          "writes": "ClusterUnreachable", "refused": "PropagationFailed"}.get(
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
        if changes and self._patch_status("deployments", ED, obj, changes):
            log.info("status of %s: %s", _key(obj), json.dumps(changes, sort_keys=True)[:2000])

    def _patch_status(self, informer: str, kind: str, obj: dict[str, Any], changes: Mapping[str, Any]) -> bool:
        """Patch a hub object's status; False when it is gone. A round reads a snapshot and then spends
        time writing to spokes, so the object may have been deleted since: skip it once the watch said so,
        and take the server's 404 (deleted between that check and the patch) as the same news, not as a
        failed round."""
        meta = obj["metadata"]
        watching = self.informers.get(informer)
        if watching is None or watching.holds(obj):
            try:
                self.hub.patch_status(kind, meta["name"], meta.get("namespace"), changes)
                return True
            except KubeError as exc:
                if exc.status != 404:
                    raise
        log.info("%s %s was deleted during the round; its status is not written", kind, object_key(obj))
        return False

    # ------------------------------------------------------------ thread

    def run_forever(self, on_round: Callable[[float], None] | None = None) -> None:
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                self.wake.clear()
                try:
                    self.run_round()
                except Exception:  # one bad round (API hiccup) must not stop scheduling for good
                    metrics.HUB_ROUND_FAILURES.inc()
                    log.exception("hub scheduling round failed; retrying next interval")
                metrics.HUB_ROUND_SECONDS.observe(time.monotonic() - started)
                if on_round is not None:
                    on_round(time.monotonic() - started)
                if self.stop.wait(MIN_GAP_S):
                    break
                self.wake.wait(max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            self.close()
