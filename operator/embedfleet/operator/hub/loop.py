"""One scheduling round of the hub, and the thread that repeats it every interval.

A round: read every FleetCluster's heartbeat lease on its spoke (through the kubeconfig Secret) and update
its health, read each hub EmbeddingDeployment and what its spokes report, compute fleet-wide targets,
call the pure ``place()``, then write each spoke's share (creating, reverting drift, deleting what is no
longer placed) and the hub object's status. Everything is re-derived each round from the API servers
plus an in-memory health table, so a restarted hub resumes where the last one stopped (previous shares
come from ``status.clusters``).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kubernetes
import yaml
from pydantic import ValidationError

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import (
    FLEET_CLUSTER_KIND,
    FLEET_CLUSTER_PLURAL,
    PLACEMENT_POLICY_KIND,
    PLACEMENT_POLICY_PLURAL,
    FleetClusterSpec,
    PlacementPolicySpec,
)
from embedfleet.operator.handlers import status as st
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.autoscale import fleet_target
from embedfleet.operator.hub.health import Health, observe
from embedfleet.operator.kube import KINDS, Kind, Kube, KubeError, merge_patch_deletions
from embedfleet.operator.scheduling import Cluster, Deployment, place
from embedfleet.operator.spoke.heartbeat import (
    CACHED_ANNOTATION,
    LEASE_NAME,
)
from embedfleet.operator.validate import check

log = logging.getLogger(__name__)

KINDS.setdefault(FLEET_CLUSTER_KIND, Kind(naming.API_VERSION, FLEET_CLUSTER_PLURAL, False))
KINDS.setdefault(PLACEMENT_POLICY_KIND, Kind(naming.API_VERSION, PLACEMENT_POLICY_PLURAL, False))
KINDS.setdefault("Secret", Kind("v1", "secrets", True))
KINDS.setdefault("Namespace", Kind("v1", "namespaces", False))
KINDS.setdefault("Lease", Kind("coordination.k8s.io/v1", "leases", True))

ED = naming.EMBEDDING_DEPLOYMENT_KIND
ED_PATH = f"/apis/{naming.API_VERSION}/{naming.EMBEDDING_DEPLOYMENT_PLURAL}"
ENV_INTERVAL = "EMBEDFLEET_HUB_INTERVAL"
ENV_RAMP = "EMBEDFLEET_HUB_RAMP_SECONDS"
SPOKE_ERRORS = (KubeError, OSError, kubernetes.client.ApiException, kubernetes.config.ConfigException,
                ValueError)


def _wall() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _age(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (datetime.now(UTC) - parsed).total_seconds()


def _list_all(kube: Kube, path: str, selector: str | None = None) -> list[dict[str, Any]]:
    query = [("labelSelector", selector)] if selector else None
    data = kube._request("GET", path, query=query)
    return list((data or {}).get("items") or [])


@dataclass
class SpokeLink:
    kube: Kube
    fingerprint: str


@dataclass
class HubState:
    health: dict[str, Health] = field(default_factory=dict)
    links: dict[str, SpokeLink] = field(default_factory=dict)
    last_seen: dict[str, str] = field(default_factory=dict)


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
            link = SpokeLink(Kube(kubernetes.client.ApiClient(configuration=config)), fingerprint)
            self.state.links[name] = link
        return link

    def _observe_cluster(self, fc: dict[str, Any], now: float) -> tuple[Cluster | None, SpokeLink | None]:
        name = fc["metadata"]["name"]
        try:
            spec = FleetClusterSpec.model_validate(fc.get("spec") or {})
        except ValidationError as exc:
            cond = st.condition("Joined", False, "InvalidSpec", str(exc)[:1000])
            self._cluster_status(fc, {"conditions": [cond]})
            return None, None
        link: SpokeLink | None = None
        renew: str | None = None
        cached: list[str] = []
        error = ""
        try:
            link = self._link(name, spec)
            lease = link.kube.get("Lease", LEASE_NAME, spec.connection.namespace)
            if lease is not None:
                renew = (lease.get("spec") or {}).get("renewTime")
                annotations = (lease.get("metadata") or {}).get("annotations") or {}
                cached = [c for c in (annotations.get(CACHED_ANNOTATION) or "").split(",") if c]
        except SPOKE_ERRORS as exc:
            error = str(exc)[:500]
        previous = self.state.health.get(name, Health())
        health = observe(previous, renew, now, spec.lease.duration_seconds, spec.lease.grace_seconds,
                         first_sight_age=_age(renew))
        self.state.health[name] = health
        if health.last_heartbeat is not None:
            seen = self.state.last_seen.get(name) if health.last_heartbeat == previous.last_heartbeat else None
            self.state.last_seen[name] = seen or _wall()
        message = error or f"lease {LEASE_NAME} in {spec.connection.namespace}: {health.reason}"
        status = {
            "conditions": st.merge_conditions(
                (fc.get("status") or {}).get("conditions"),
                [st.condition("Joined", health.joined, "HeartbeatSeen" if health.joined else "NeverSeen",
                              message),
                 st.condition("Available", health.available, health.reason, message)],
                _wall(),
            ),
            "lastHeartbeat": self.state.last_seen.get(name),
            "renewTime": health.renew_time,
            "cachedModels": sorted(cached),
            "allocatable": spec.capacity.model_dump(by_alias=True),
        }
        self._cluster_status(fc, status)
        cluster = convert.cluster_from(name, spec, health, cached)
        return cluster, link

    def _cluster_status(self, fc: dict[str, Any], wanted: dict[str, Any]) -> None:
        changes = st.status_patch(fc.get("status"), wanted)
        if changes:
            self.hub.patch_status(FLEET_CLUSTER_KIND, fc["metadata"]["name"], None, changes)

    # ------------------------------------------------------------ one round

    def run_round(self) -> None:
        now = time.monotonic()
        clusters: dict[str, Cluster] = {}
        links: dict[str, SpokeLink] = {}
        for fc in _list_all(self.hub, KINDS[FLEET_CLUSTER_KIND].path()):
            cluster, link = self._observe_cluster(fc, now)
            if cluster is not None:
                clusters[cluster.name] = cluster
                if link is not None and cluster.available:
                    links[cluster.name] = link
        policies = []
        for pp in _list_all(self.hub, KINDS[PLACEMENT_POLICY_KIND].path()):
            try:
                spec = PlacementPolicySpec.model_validate(pp.get("spec") or {})
            except ValidationError as exc:
                log.warning("PlacementPolicy %s ignored: %s", pp["metadata"]["name"], exc)
                continue
            policies.append(convert.policy_from(pp["metadata"]["name"], spec))

        hub_objects = _list_all(self.hub, ED_PATH)
        deployments: list[Deployment] = []
        spoke_views: dict[str, dict[str, dict[str, Any] | None]] = {}
        info: dict[str, tuple[dict[str, Any], int]] = {}
        ns_labels: dict[str, dict[str, str]] = {}
        for obj in hub_objects:
            meta = obj["metadata"]
            key = f"{meta['namespace']}/{meta['name']}"
            parsed, problems = check(meta["name"], dict(obj.get("spec") or {}))
            if parsed is None:
                self._hub_status(obj, None, [st.condition("Accepted", False, "InvalidSpec", "; ".join(problems),
                                                          meta.get("generation"))], None)
                continue
            views = {c: self._spoke_get(link, meta) for c, link in links.items()}
            spoke_views[key] = views
            reports = [float((v.get("status") or {}).get("inFlight")) for v in views.values()
                       if v is not None and (v.get("status") or {}).get("inFlight") is not None]
            status = obj.get("status") or {}
            target = fleet_target(parsed, sum(reports) if reports else None, status.get("targetReplicas"))
            previous = {r["name"]: int(r.get("desired") or 0) for r in status.get("clusters") or []}
            running = {r["name"]: int(r.get("ready") or 0) for r in status.get("clusters") or []}
            if meta["namespace"] not in ns_labels:
                ns_labels[meta["namespace"]] = self._namespace_labels(meta["namespace"])
            deployments.append(convert.deployment_from(key, parsed, ns_labels[meta["namespace"]], target, previous,
                                                       running))
            info[key] = (obj, target)

        placements = place(deployments, clusters.values(), policies, now, ramp_seconds=self.ramp)
        for key, placement in placements.items():
            obj, target = info[key]
            views = spoke_views[key]
            rows = []
            for cname, link in links.items():
                share = placement.clusters.get(cname)
                live = views.get(cname)
                try:
                    live = self._propagate(link, obj, cname, share, live)
                except SPOKE_ERRORS as exc:
                    log.warning("propagating %s to %s failed: %s", key, cname, exc)
                if share is not None or live is not None:
                    rows.append(convert.spoke_row(cname, share, clusters[cname].region, live,
                                                  self.state.last_seen.get(cname)))
            for cname, share in placement.clusters.items():
                if cname not in links:  # placed but unreachable right now
                    rows.append(convert.spoke_row(cname, share, clusters[cname].region, None,
                                                  self.state.last_seen.get(cname)))
            rows.sort(key=lambda r: r["name"])
            self._hub_status(obj, placement, self._conditions(obj, placement, rows), rows, target)
        self._collect_garbage(links, {f"{o['metadata']['namespace']}/{o['metadata']['name']}" for o in hub_objects})

    def _namespace_labels(self, namespace: str) -> dict[str, str]:
        """For PlacementPolicy namespace selectors; an unreadable namespace matches only selector-less policies."""
        try:
            ns = self.hub.get("Namespace", namespace)
        except KubeError as exc:
            log.warning("reading namespace %s failed, treating it as unlabelled: %s", namespace, exc)
            return {}
        return dict(((ns or {}).get("metadata") or {}).get("labels") or {})

    def _spoke_get(self, link: SpokeLink, meta: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            return link.kube.get(ED, meta["name"], meta["namespace"])
        except SPOKE_ERRORS:
            return None

    def _propagate(
        self, link: SpokeLink, obj: dict[str, Any], cname: str, share: Any, live: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        meta = obj["metadata"]
        if share is None:
            labels = ((live or {}).get("metadata") or {}).get("labels") or {}
            if live is not None and convert.HUB_MANAGED_LABEL in labels:
                link.kube.delete(ED, meta["name"], meta["namespace"])
                log.info("removed %s/%s from %s (no longer placed there)", meta["namespace"], meta["name"], cname)
            return None
        wanted = convert.spoke_manifest(obj, cname, share)
        if live is None:
            link.kube._request("POST", KINDS[ED].path(meta["namespace"]), body=wanted)
            log.info("placed %s/%s on %s: %s", meta["namespace"], meta["name"], cname, share.range)
            return wanted
        if convert.drifted(live, wanted):
            patch = {"metadata": {"labels": wanted["metadata"]["labels"],
                                  "annotations": wanted["metadata"]["annotations"]},
                     "spec": merge_patch_deletions(live.get("spec") or {}, wanted["spec"])}
            link.kube.patch_merge(ED, meta["name"], meta["namespace"], patch)
            log.info("updated %s/%s on %s: %s", meta["namespace"], meta["name"], cname, share.range)
            return {**live, "spec": wanted["spec"]}
        return live

    def _conditions(self, obj: dict[str, Any], placement: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        gen = obj["metadata"].get("generation")
        if not placement.accepted:
            return [st.condition("Accepted", False, "PolicyConflict", "; ".join(placement.problems), gen)]
        policy = f" (PlacementPolicy {placement.policy})" if placement.policy else ""
        accepted = st.condition("Accepted", True, "Valid", f"mode {placement.mode}{policy}", gen)
        placed = placement.placed
        ok = placed >= placement.target and not placement.problems
        shares = ", ".join(f"{n}={c.range.desired}" for n, c in sorted(placement.clusters.items()))
        placed_c = st.condition("Placed", ok, "Placed" if ok else "Constrained",
                                "; ".join([f"{placed}/{placement.target} replicas: {shares}", *placement.problems]),
                                gen)
        ready = sum(int(r["ready"] or 0) for r in rows)
        available = st.condition("Available", ready > 0, "ReplicasReady" if ready else "NoReadyReplicas",
                                 f"{ready} ready across {len(rows)} cluster(s)", gen)
        degraded = st.condition("Degraded", bool(placement.problems), "Constrained" if placement.problems else
                                "Healthy", "; ".join(placement.problems), gen)
        return [accepted, placed_c, available, degraded]

    def _hub_status(self, obj: dict[str, Any], placement: Any, conditions: list[dict[str, Any]],
                    rows: list[dict[str, Any]] | None, target: int | None = None) -> None:
        status = obj.get("status") or {}
        wanted: dict[str, Any] = {
            "observedGeneration": obj["metadata"].get("generation"),
            "conditions": st.merge_conditions(status.get("conditions"), conditions, _wall()),
        }
        if rows is not None:
            wanted["clusters"] = rows
            wanted["targetReplicas"] = target
            ready = sum(int(r["ready"] or 0) for r in rows)
            wanted["replicas"] = {"desired": placement.placed, "ready": ready,
                                  "current": sum(int(r["desired"]) for r in rows)}
            inflight = [r["inflight"] for r in rows if r["inflight"] is not None]
            wanted["inFlight"] = sum(inflight) if inflight else None
        changes = st.status_patch(status, wanted)
        if changes:
            meta = obj["metadata"]
            self.hub.patch_status(ED, meta["name"], meta["namespace"], changes)

    def _collect_garbage(self, links: Mapping[str, SpokeLink], keys: set[str]) -> None:
        """Spoke copies of hub objects that no longer exist on the hub."""
        for cname, link in links.items():
            try:
                for item in _list_all(link.kube, ED_PATH, f"{convert.HUB_MANAGED_LABEL}={cname}"):
                    meta = item["metadata"]
                    labels = meta.get("labels") or {}
                    if labels.get(convert.HUB_MANAGED_LABEL) != cname:
                        continue
                    if f"{meta['namespace']}/{meta['name']}" not in keys:
                        link.kube.delete(ED, meta["name"], meta["namespace"])
                        log.info("removed orphan %s/%s from %s", meta["namespace"], meta["name"], cname)
            except SPOKE_ERRORS as exc:
                log.warning("garbage collection on %s failed: %s", cname, exc)

    # ------------------------------------------------------------ thread

    def run_forever(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.run_round()
            except Exception:  # one bad round (API hiccup) must not stop scheduling for good
                log.exception("hub scheduling round failed; retrying next interval")
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
