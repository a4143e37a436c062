"""The FleetClusters as the hub sees them: each spoke's health judged from its heartbeat Lease (as the
spoke's watch last showed it) and from its credentials, written to the FleetCluster's status, and whether
a placement pass may read and write its copies.

The cluster reconcile (controller.py) runs ``observe`` for one FleetCluster; it is the hub's judgement of one
spoke, with its own memory across reconciles
(``HubState.health``, ``seen``, ``policies``, ``credentials``): a kubeconfig that is broken, expired or
refused is ``CredentialsValid=False`` and freezes that spoke's last known health, so it does not fail over
everything it runs; a spoke whose lease cannot be read keeps the platform policy it last published; and
times are recorded when the health changes, never per heartbeat (that would be a write per beat).

On a spoke this reads only, through the link's informers (links.py): ``list``/``watch`` the hub-managed
EmbeddingDeployments and ``get``/``list``/``watch`` its heartbeat Lease.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from embedfleet.operator import metrics
from embedfleet.operator import status as st
from embedfleet.operator.crd.fleet import FLEET_CLUSTER_KIND, FleetClusterSpec
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.errors import credential_problem, describe
from embedfleet.operator.hub.health import Health, observe
from embedfleet.operator.hub.reporting import Reporter
from embedfleet.operator.hub.stamps import age, stamp, wall
from embedfleet.operator.hub.state import HubState, SpokeLink, SpokeView
from embedfleet.operator.spoke import gateway_load
from embedfleet.operator.spoke.heartbeat import (
    CACHED_ANNOTATION,
    GATEWAY_LOAD_ANNOTATION,
    LEASE_NAME,
    POLICY_ANNOTATION,
    PROBLEM_ANNOTATION,
)

log = logging.getLogger(__name__)


def _condition(status: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any]:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}


class Clusters:
    """Observes the FleetClusters into ``SpokeView``s, keeping what it learns in ``state``; patches their
    status through ``reporter``."""

    def __init__(self, state: HubState, reporter: Reporter) -> None:
        self.state = state
        self.reporter = reporter

    def specs(self, clusters: Mapping[str, dict[str, Any]], report: bool = True) -> dict[str, FleetClusterSpec]:
        """The FleetClusters' specs, parsed; an invalid one is left out, and reported on it
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
                self.write_status(fc, {"conditions": st.merge_conditions(
                    live_status.get("conditions"), [cond], wall())})
        return specs

    def observe(self, fc: dict[str, Any], spec: FleetClusterSpec, now: float,
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
        if not lease_read:  # unknown now: keep what the spoke last reported
            cached = list(live_status.get("cachedModels") or [])
            load = gateway_load.from_mapping(live_status.get("gateway"))
        previous = self.state.health.get(name, Health())
        if credentials is not None:
            # The hub cannot see the spoke, which says nothing about whether it runs: keep what was known
            # (a spoke never seen stays unplaced), rather than fail over everything it serves.
            health = previous
        else:
            health = observe(previous, renew, now, spec.lease.duration_seconds, spec.lease.grace_seconds,
                             first_sight_age=age(renew))
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
            since = wall()

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
        self.write_status(fc, {
            "conditions": st.merge_conditions(live_status.get("conditions"), conds, wall()),
            "lastHeartbeat": last_seen,
            "renewTime": renew_time,
            "availableSince": since,
            "cachedModels": sorted(cached),
            "allocatable": spec.capacity.model_dump(by_alias=True),
            # written only when a number changes: an idle fleet's stay 0, and status stays unwritten
            "gateway": gateway_load.cluster_status(spec.gateway_url, load),
        })
        cluster = convert.cluster_from(name, spec, health, cached, policy_key)
        return SpokeView(name, spec.region, cluster, health, link, error, last_seen, policy=policy,
                         gateway_url=spec.gateway_url, labels=dict(fc["metadata"].get("labels") or {}))

    @staticmethod
    def copies_of(view: SpokeView, now: float) -> None:
        """The copies on an available spoke as its watch shows them, or why a placement pass leaves it
        alone (fills ``view.copies``, or ``skipped`` and ``held``)."""
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
            view.skipped = True  # the watch has not shown the hub's last writes yet: judged once it has
            return
        view.copies = link.copies.items()

    def _seen_at(self, name: str, health: Health, now: float) -> str | None:
        """The hub's wall time of the renewal ``health`` last saw (kept, so it reads the same each time)."""
        if health.last_heartbeat is None:
            return None
        mono, seen = self.state.seen.get(name, (None, ""))
        if mono != health.last_heartbeat:
            seen = stamp(datetime.now(UTC) - timedelta(seconds=max(0.0, now - health.last_heartbeat)))
            self.state.seen[name] = (health.last_heartbeat, seen)
        return seen

    def write_status(self, fc: dict[str, Any], wanted: dict[str, Any]) -> None:
        changes = convert.status_changes(fc.get("status"), wanted)
        if changes:
            self.reporter.patch_status("clusters", FLEET_CLUSTER_KIND, fc, changes)

    def forget(self, names: Iterable[str]) -> None:
        """FleetClusters that were deleted: their links and informers stop."""
        for name in list(names):
            link = self.state.links.pop(name, None)
            if link is not None:
                link.close()
            try:
                metrics.BREAKER_OPEN.remove(name)
            except KeyError:  # never exported
                pass
            for table in (self.state.health, self.state.seen, self.state.policies, self.state.credentials,
                      self.state.views):
                table.pop(name, None)
