"""The fleet's placement: every hub EmbeddingDeployment placed on the spokes by the pure ``place()``, the
writes that bring each spoke's copies to their shares, and the hub objects' status from the outcome.

One reconcile for the whole fleet, not one per deployment: ``place()`` shares each cluster's capacity
among all deployments (fleet-wide targets, a returning spoke's ramp, the rollout waves), so it decides them
together. What it reads is what the informers and the cluster reconciles already hold (``HubState.views``:
each spoke's health and platform policy as last judged); it calls no API server for reads. Its writes go to
each spoke's own writer thread (writes.py), so a slow spoke delays only its own copies: a spoke whose last
batch still runs, whose breaker is open, or whose watch has not yet shown the hub's last writes is skipped
and its status rows carried over.

Idle passes write nothing: a copy is written only when the live one does not already cover what the hub
wants (``kube.up_to_date``), a status only when a value changed (``convert.status_changes``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from embedfleet.operator import status as st
from embedfleet.operator.autoscale_target import of_parsed
from embedfleet.operator.crd.fleet import PlacementPolicySpec
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.autoscale import fleet_target
from embedfleet.operator.hub.clusters import Clusters
from embedfleet.operator.hub.informer import Informer, object_key
from embedfleet.operator.hub.propagate import Needs, needs_of
from embedfleet.operator.hub.reporting import Reporter
from embedfleet.operator.hub.stamps import parse_wall, wall_stamp
from embedfleet.operator.hub.state import HubState, SpokeView
from embedfleet.operator.hub.writes import REFUSAL_RETRY_S, SpokeWrites, Write, fingerprint
from embedfleet.operator.kube import up_to_date
from embedfleet.operator.rollout import waves
from embedfleet.operator.scheduling import Deployment, Placement, place
from embedfleet.operator.scheduling.learn import Learned, model_identity
from embedfleet.operator.scheduling.spill import spill_targets
from embedfleet.operator.spoke.heartbeat import THROUGHPUT_ANNOTATION
from embedfleet.operator.validate import check

log = logging.getLogger(__name__)


def _ready(copy: Mapping[str, Any] | None) -> int:
    """Ready replicas a spoke's copy reports (0: no copy, no status yet, or being deleted)."""
    if copy is None or (copy.get("metadata") or {}).get("deletionTimestamp"):
        return 0
    replicas = ((copy.get("status") or {}).get("replicas") or {})
    try:
        return int(replicas.get("ready") or 0)
    except (TypeError, ValueError):
        return 0


class Placing:
    """The placement reconcile. ``informers`` are the hub's collections by name (the controller's dict)."""

    def __init__(self, state: HubState, informers: Mapping[str, Informer], clusters: Clusters,
                 reporter: Reporter, writes: SpokeWrites, ramp: float, secret_recheck: float) -> None:
        self.state = state
        self.informers = informers
        self.clusters = clusters
        self.reporter = reporter
        self.writes = writes
        self.ramp = ramp
        self.secret_recheck = secret_recheck
        #: Embeddings per second per busy replica, per (model, resource), smoothed over the spokes' heartbeats.
        self.learned = Learned()

    def learn(self, views: Mapping[str, SpokeView]) -> None:
        """Take each spoke's throughput report from its heartbeat Lease (as its informer holds it) into the
        smoothed table the cost ranking reads (scheduling/learn.py); a spoke whose Lease is unread keeps
        what it reported last."""
        reports: dict[str, str | None] = {}
        for name, view in views.items():
            lease = view.link.lease if view.link is not None else None
            if lease is None or not lease.synced:
                continue
            for item in lease.items().values():
                reports[name] = ((item.get("metadata") or {}).get("annotations") or {}).get(THROUGHPUT_ANNOTATION)
        self.learned.observe_all(reports)

    def views(self, now: float) -> dict[str, SpokeView]:
        """Each judged spoke as this pass sees it: its health as last judged, and its copies as its watch
        shows them now (or why it is left alone this pass)."""
        out = {}
        for name, judged in self.state.views.items():
            view = dataclasses.replace(judged, copies=None, held=None, skipped=False)
            self.clusters.copies_of(view, now)
            out[name] = view
        return out

    def reconcile(self) -> dict[str, Placement]:
        """One pass over the fleet; returns the placements (the PlacementPolicies' status is written from
        them)."""
        now = time.monotonic()
        views = self.views(now)
        policies, policy_specs = [], {}
        for pp in self.informers["policies"].items().values():
            try:
                spec = PlacementPolicySpec.model_validate(pp.get("spec") or {})
            except ValidationError as exc:
                log.warning("PlacementPolicy %s ignored: %s", pp["metadata"]["name"], exc)
                continue
            policies.append(convert.policy_from(pp["metadata"]["name"], spec))
            policy_specs[pp["metadata"]["name"]] = spec

        # Each distinct spoke policy once; every deployment is checked against each of them once per pass.
        spoke_policies = {v.cluster.platform_policy: v.policy for v in views.values()}
        namespaces = self.informers["namespaces"].items()
        hub_objects = list(self.informers["deployments"].items().values())
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
            deployment = convert.deployment_from(key, parsed, labels, target, previous, running, refused)
            deployments.append(dataclasses.replace(
                deployment, model=model_identity(parsed.model.source, parsed.model.revision)))
            info[key] = (obj, target)
            parsed_specs[key] = parsed

        self.learn(views)
        placements = place(deployments, [v.cluster for v in views.values()], policies, now, ramp_seconds=self.ramp,
                           throughput=self.learned.throughput())
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
            self.reporter.reconcile(obj, placement, target, views, outcomes, decisions[key],
                                    of_parsed(parsed_specs[key]).deprecation)
        return placements

    def _rollout(self, obj: dict[str, Any], spec: EmbeddingDeploymentSpec, placement: Placement,
                 views: Mapping[str, SpokeView]) -> waves.Decision:
        """This pass's rollout decision (rollout/waves.py) from the copies as each spoke's watch last
        showed them (a spoke skipped this pass still reports), with the soak clock this hub keeps."""
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
            share = placement.share(name, view.region)
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
