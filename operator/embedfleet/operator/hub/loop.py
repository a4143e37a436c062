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

This module is the orchestrator: ``HubLoop`` owns the hub's informers, the round's order and the planning
(what each spoke should hold, rollout waves included), and hands each step to a collaborator that receives
what it needs (the hub ``Kube``, the shared ``HubState``, the informers):

* links.py: ``Links``, the spokes' clients and informers from their kubeconfig Secrets;
* clusters.py: ``Clusters``, each FleetCluster's health and status, and whether its copies may be read;
* writes.py: ``SpokeWrites``, each spoke's write batch on that spoke's own writer thread;
* reporting.py: ``Reporter``, the hub objects' status and Events;
* state.py: the records they share (``HubState``, ``SpokeLink``, ``SpokeView``); stamps.py: status times.

The names other code and tests use (``HubState``, ``SpokeLink``, ``Write``, ``LEASE_NAME``, the constants)
are importable from here as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from embedfleet.operator import metrics
from embedfleet.operator import status as st
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import FLEET_CLUSTER_KIND, PLACEMENT_POLICY_KIND, PlacementPolicySpec
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.autoscale import fleet_target
from embedfleet.operator.hub.clusters import Clusters
from embedfleet.operator.hub.credentials import CredentialPolicy
from embedfleet.operator.hub.informer import Informer, object_key
from embedfleet.operator.hub.links import (
    CREDENTIALS_RECHECK_S,
    CREDENTIALS_RETRY_S,
    ED_PATH,
    LINK_WAIT_S,
    SPOKE_RETRIES,
    Links,
)
from embedfleet.operator.hub.propagate import Needs, needs_of
from embedfleet.operator.hub.reporting import ED, Reporter
from embedfleet.operator.hub.stamps import parse_wall, wall_stamp
from embedfleet.operator.hub.state import HubState, SpokeLink, SpokeView
from embedfleet.operator.hub.writes import REFUSAL_RETRY_S, ROUND_WAIT_S, Outcome, SpokeWrites, Write, fingerprint
from embedfleet.operator.kube import Kube, up_to_date
from embedfleet.operator.rollout import waves
from embedfleet.operator.scheduling import Deployment, Placement, place
from embedfleet.operator.scheduling.spill import spill_targets
from embedfleet.operator.spoke.heartbeat import LEASE_NAME
from embedfleet.operator.validate import check

__all__ = [
    "CREDENTIALS_RECHECK_S", "CREDENTIALS_RETRY_S", "ED", "ED_PATH", "ENV_CREDENTIALS_RECHECK", "ENV_INTERVAL",
    "ENV_RAMP", "ENV_SECRET_RECHECK", "ENV_WRITE_TIMEOUT", "LEASE_NAME", "LINK_WAIT_S", "MIN_GAP_S",
    "REFUSAL_RETRY_S", "ROUND_WAIT_S", "SECRET_RECHECK_S", "SPOKE_RETRIES", "HubLoop", "HubState", "Outcome",
    "SpokeLink", "SpokeView", "Write",
]

log = logging.getLogger(__name__)

ENV_INTERVAL = "EMBEDFLEET_HUB_INTERVAL"
ENV_RAMP = "EMBEDFLEET_HUB_RAMP_SECONDS"
ENV_WRITE_TIMEOUT = "EMBEDFLEET_HUB_WRITE_TIMEOUT"
ENV_CREDENTIALS_RECHECK = "EMBEDFLEET_HUB_CREDENTIALS_RECHECK"
ENV_SECRET_RECHECK = "EMBEDFLEET_HUB_SECRET_RECHECK"
#: How often the hub compares a propagated Secret with its own (one get on the hub): a rotated API key
#: reaches the spokes within this time (the default; EMBEDFLEET_HUB_SECRET_RECHECK overrides it).
SECRET_RECHECK_S = 300.0
#: An intent change wakes the loop early, but rounds start at most this often.
MIN_GAP_S = 0.2


def _ready(copy: Mapping[str, Any] | None) -> int:
    """Ready replicas a spoke's copy reports (0: no copy, no status yet, or being deleted)."""
    if copy is None or (copy.get("metadata") or {}).get("deletionTimestamp"):
        return 0
    replicas = ((copy.get("status") or {}).get("replicas") or {})
    try:
        return int(replicas.get("ready") or 0)
    except (TypeError, ValueError):
        return 0


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
        #: The hub's own collections by name, filled (in place: the reporter holds the same dict) on first use.
        self.informers: dict[str, Informer] = {}
        self.links = Links(self.hub, self.state, self.credential_policy, self.write_timeout,
                           self.credentials_recheck)
        self.reporter = Reporter(self.hub, self.informers)
        self.clusters = Clusters(self.state, self.reporter)
        self.writes = SpokeWrites(self.hub)
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
            self.informers.update({name: Informer(self.hub, path, name=f"hub-{name}", kind=watched[name],
                                                  on_change=None if name == "namespaces" else wake).start()
                                   for name, path in paths.items()})
        return self.informers

    def warm(self) -> None:
        """Open every watch a round needs without running one (a standby's caches; writes nothing)."""
        with self._busy:
            informers = self._hub_informers()
            if all(inf.wait_synced(30) for inf in informers.values()):
                self.links.connect(self.clusters.specs(informers["clusters"].items(), report=False),
                                   time.monotonic())

    def close(self) -> None:
        for informer in self.informers.values():
            informer.stop(timeout=0.1)
        self.links.close()

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
        self.clusters.forget(set(self.state.links) - set(clusters))
        specs = self.clusters.specs(clusters)
        links = self.links.connect(specs, now)
        for name, link in self.state.links.items():
            metrics.BREAKER_OPEN.labels(cluster=name).set(1 if link.breaker.is_open(now) else 0)
        for name, spec in specs.items():
            views[name] = self.clusters.observe(clusters[name], spec, now, links.get(name))
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
            key = object_key(obj)
            parsed, problems = check(meta["name"], dict(obj.get("spec") or {}))
            if parsed is None:
                conds = [st.condition("Accepted", False, "InvalidSpec", "; ".join(problems), meta.get("generation"))]
                self.reporter.write_status(obj, {"observedGeneration": meta.get("generation"), "conditions": conds})
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
        self.reporter.write_policy_statuses(informers["policies"].items(), placements)
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
                plans[view.name] += self._orphans(view, set(info) | {object_key(o) for o in hub_objects})
        outcomes = self.writes.run(views, plans)
        for key, placement in placements.items():
            obj, target = info[key]
            self.reporter.reconcile(obj, placement, target, views, outcomes, decisions[key])

    # ------------------------------------------------------------ planning

    def _rollout(self, obj: dict[str, Any], spec: EmbeddingDeploymentSpec, placement: Placement,
                 views: Mapping[str, SpokeView]) -> waves.Decision:
        """This round's rollout decision (rollout/waves.py) from the copies as each spoke's watch last
        showed them (a spoke skipped this round still reports), with the soak clock this hub keeps."""
        key = object_key(obj)
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
        decision = waves.decide(status, spec, members, copies, time.time(), since, wall_stamp, parse_wall)
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
        key = object_key(obj)
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
            if refused is not None and refused[2] == fingerprint(manifest) and \
                    time.monotonic() - refused[0] < REFUSAL_RETRY_S:
                continue  # refused a moment ago, and nothing changed: its problem stays in status
            if live is None or not up_to_date(live, manifest) or stale_secret or key in view.link.unsure:
                plans[name].append(Write(key, share, manifest, live, needs))

    def _orphans(self, view: SpokeView, keys: set[str]) -> list[Write]:
        """Deletions of spoke copies whose hub object no longer exists."""
        assert view.copies is not None
        return [Write(key, None, None, item, Needs(key.split("/", 1)[0])) for key, item in view.copies.items()
                if key not in keys and not (item.get("metadata") or {}).get("deletionTimestamp")]

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
