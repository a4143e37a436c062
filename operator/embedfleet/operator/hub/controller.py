"""The hub's controller: reconcilers per kind on the kit's informers and work queue (embedfleet/kit).

Three kinds of key on one rate-limited, deduplicating queue, drained by one worker:

* ``cluster/<name>``: one FleetCluster's health (clusters.py), from its heartbeat Lease as the spoke's watch
  shows it and from its credentials; the link to the spoke (links.py) is made or renewed here. It is
  queued when the FleetCluster or the spoke's Lease changes, and again when the health would change by
  itself (the lease running out, health.next_change), so a spoke that goes silent is judged on time.
  When what placement depends on changes (available, the platform policy, the link), placement is queued.
* ``placement``: the whole fleet placed at once (placing.py), because ``place()`` shares capacity among
  all deployments. Queued by any change of an EmbeddingDeployment, PlacementPolicy or Namespace on the hub
  and of a copy on a spoke, coalesced over MIN_GAP_S, and at the resync interval (``--hub-interval``):
  events make it prompt, the resync makes it converge after anything an event could not say (a soak
  period ending, a refused write's retry time).
* ``policy/<name>``: a PlacementPolicy's status, from the last placement (queued after each one).

One worker, so the reconcilers never race on the shared ``HubState``; none of them waits on a spoke: reads
come from informers, and writes to spokes run on each spoke's own writer thread (writes.py), so a slow or
hung spoke delays only its own copies. A reconcile that raises is retried with the queue's back-off
(``embedfleet_operator_workqueue_retries_total``) instead of waiting for the next resync; each reconcile is
timed in ``embedfleet_operator_reconcile_seconds{kind}`` like the kopf handlers of the other roles.

A standby (main.py waits for the leader Lease) runs ``warm``: the informers and links are open and synced,
nothing is written, and no worker runs until it leads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from embedfleet.kit.workqueue import Result, Workers, WorkQueue, prometheus_metrics
from embedfleet.operator import metrics
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import FLEET_CLUSTER_KIND, PLACEMENT_POLICY_KIND
from embedfleet.operator.hub.clusters import Clusters
from embedfleet.operator.hub.credentials import CredentialPolicy
from embedfleet.operator.hub.health import next_change
from embedfleet.operator.hub.informer import Informer
from embedfleet.operator.hub.links import CREDENTIALS_RECHECK_S, CREDENTIALS_RETRY_S, ED_PATH, Links
from embedfleet.operator.hub.placing import Placing
from embedfleet.operator.hub.reporting import Reporter
from embedfleet.operator.hub.state import HubState, SpokeView
from embedfleet.operator.hub.writes import SpokeWrites
from embedfleet.operator.kube import Kube

log = logging.getLogger(__name__)

ENV_INTERVAL = "EMBEDFLEET_HUB_INTERVAL"
ENV_RAMP = "EMBEDFLEET_HUB_RAMP_SECONDS"
ENV_WRITE_TIMEOUT = "EMBEDFLEET_HUB_WRITE_TIMEOUT"
ENV_CREDENTIALS_RECHECK = "EMBEDFLEET_HUB_CREDENTIALS_RECHECK"
ENV_SECRET_RECHECK = "EMBEDFLEET_HUB_SECRET_RECHECK"
#: How often the hub compares a propagated Secret with its own (one get on the hub): a rotated API key
#: reaches the spokes within this time (the default; EMBEDFLEET_HUB_SECRET_RECHECK overrides it).
SECRET_RECHECK_S = 300.0
#: Changes are coalesced: placement runs at most this long after the change that queued it, and a burst
#: of changes within it costs one pass.
MIN_GAP_S = 0.2
PLACEMENT = "placement"
CLUSTER, POLICY = "cluster/", "policy/"
#: The queue's metrics (``embedfleet_operator_workqueue_*{name="hub"}``), bound once per process.
QUEUE_METRICS = prometheus_metrics("embedfleet_operator")


def _placement_inputs(view: SpokeView | None) -> tuple[Any, ...] | None:
    """What a placement pass reads from a cluster's judgement: a change of any of it queues placement."""
    if view is None:
        return None
    return (view.health.available, view.health.reason, view.cluster, id(view.link), view.error, view.region,
            view.gateway_url, dict(view.labels), repr(view.policy))


class HubController:
    def __init__(self, hub: Kube | None = None, interval: float | None = None, ramp: float | None = None,
                 write_timeout: float | None = None) -> None:
        self.hub = hub or Kube()
        self.interval = interval if interval is not None else float(os.environ.get(ENV_INTERVAL, "10"))
        self.ramp = ramp if ramp is not None else float(os.environ.get(ENV_RAMP, "60"))
        self.write_timeout = (write_timeout if write_timeout is not None
                              else float(os.environ.get(ENV_WRITE_TIMEOUT, "10")))
        self.credentials_recheck = float(os.environ.get(ENV_CREDENTIALS_RECHECK, CREDENTIALS_RECHECK_S))
        secret_recheck = float(os.environ.get(ENV_SECRET_RECHECK, SECRET_RECHECK_S))
        self.state = HubState()
        self.stop = threading.Event()
        #: The hub's own collections by name, filled (in place: the reporter holds the same dict) on first use.
        self.informers: dict[str, Informer] = {}
        self.queue = WorkQueue("hub", base_delay=0.5, max_delay=max(1.0, self.interval), metrics=QUEUE_METRICS)
        self.links = Links(self.hub, self.state, CredentialPolicy.from_env(), self.write_timeout,
                           self.credentials_recheck, on_change=self._spoke_changed)
        self.reporter = Reporter(self.hub, self.informers)
        self.clusters = Clusters(self.state, self.reporter)
        self.placing = Placing(self.state, self.informers, self.clusters, self.reporter, SpokeWrites(self.hub),
                               self.ramp, secret_recheck)
        self._lock = threading.Lock()  # one reconcile at a time (the worker, or a caller of reconcile_all)

    # ------------------------------------------------------------ events

    def _hub_changed(self, collection: str, key: str) -> None:
        if collection == "clusters":
            self.queue.add(CLUSTER + key)
        self.queue.add_after(PLACEMENT, MIN_GAP_S)

    def _spoke_changed(self, cluster: str, what: str) -> None:
        if what == "lease":
            self.queue.add(CLUSTER + cluster)
        else:
            self.queue.add_after(PLACEMENT, MIN_GAP_S)

    def _hub_informers(self) -> dict[str, Informer]:
        """The hub's own collections, watched; started on first use."""
        if not self.informers:
            kinds = self.hub.kinds
            paths = {"clusters": kinds[FLEET_CLUSTER_KIND].path(), "policies": kinds[PLACEMENT_POLICY_KIND].path(),
                     "deployments": ED_PATH, "namespaces": kinds["Namespace"].path()}
            watched = {"clusters": FLEET_CLUSTER_KIND, "policies": PLACEMENT_POLICY_KIND,
                       "deployments": naming.EMBEDDING_DEPLOYMENT_KIND, "namespaces": "Namespace"}
            self.informers.update({
                name: Informer(self.hub, path, name=f"hub-{name}", kind=watched[name],
                               on_change=lambda key, name=name: self._hub_changed(name, key)).start()
                for name, path in paths.items()})
        return self.informers

    def _synced(self) -> bool:
        return all(inf.wait_synced(30) for inf in self._hub_informers().values())

    # ------------------------------------------------------------ reconcilers

    def reconcile(self, key: str) -> Result | None:
        """The worker's entry: one key, timed in the operator's reconcile metrics by its kind."""
        kind = (FLEET_CLUSTER_KIND if key.startswith(CLUSTER) else PLACEMENT_POLICY_KIND if key.startswith(POLICY)
                else "Placement")
        started, result = time.monotonic(), metrics.ERROR
        try:
            with self._lock:
                if not self._synced():
                    log.warning("hub informers not synced yet; %s retried", key)
                    result = metrics.RETRY
                    return Result(requeue_after=1.0)
                out = self._dispatch(key)
            result = metrics.OK
            return out
        except Exception:
            metrics.RECONCILE_ERRORS.labels(kind=kind, reason=metrics.EXCEPTION).inc()
            if key == PLACEMENT:
                metrics.HUB_ROUND_FAILURES.inc()
            raise
        finally:
            elapsed = time.monotonic() - started
            metrics.RECONCILE_SECONDS.labels(kind=kind, result=result).observe(elapsed)
            if key == PLACEMENT:
                metrics.HUB_ROUND_SECONDS.observe(elapsed)

    def _dispatch(self, key: str) -> Result | None:
        if key.startswith(CLUSTER):
            return self.reconcile_cluster(key[len(CLUSTER):])
        if key.startswith(POLICY):
            self.reconcile_policy(key[len(POLICY):])
            return None
        if key == PLACEMENT:
            self.reconcile_placement()
            return Result(requeue_after=self.interval)  # the resync
        log.warning("hub: unknown key %s dropped", key)
        return None

    def reconcile_cluster(self, name: str) -> Result | None:
        """One FleetCluster: its link, its health and status. Queues placement when what it places on
        changed; asks to be looked at again when its health would change by itself."""
        now = time.monotonic()
        fc = self.informers["clusters"].get(name)
        before = _placement_inputs(self.state.views.get(name))
        spec = self.clusters.specs({name: fc}).get(name) if fc is not None else None
        if spec is None:  # deleted, or invalid (said on its status): nothing is placed there
            if fc is None:
                self.clusters.forget([name])
            self.state.views.pop(name, None)
            if before is not None:
                self.queue.add(PLACEMENT)
            return None
        connected = self.links.connect({name: spec}, now)[name]
        link = self.state.links.get(name)
        if link is not None:
            metrics.BREAKER_OPEN.labels(cluster=name).set(1 if link.breaker.is_open(now) else 0)
        view = self.state.views[name] = self.clusters.observe(fc, spec, now, connected)
        if _placement_inputs(view) != before:
            self.queue.add(PLACEMENT)
        waits = [self.interval]
        health_due = next_change(view.health, now, spec.lease.duration_seconds, spec.lease.grace_seconds)
        if health_due is not None:
            waits.append(health_due + 0.05)
        if name in self.state.credentials:
            waits.append(min(CREDENTIALS_RETRY_S, self.credentials_recheck))
        return Result(requeue_after=min(waits))

    def reconcile_placement(self) -> None:
        # A cluster not judged yet (the hub just started, or it was just created) is judged first: placing
        # without it would move its share elsewhere for a moment.
        for name in self.informers["clusters"].items():
            if name not in self.state.views:
                self.reconcile_cluster(name)
        self.state.placements = self.placing.reconcile()
        for name in self.informers["policies"].items():
            self.queue.add(POLICY + name)

    def reconcile_policy(self, name: str) -> None:
        pp = self.informers["policies"].get(name)
        if pp is not None:
            self.reporter.write_policy_statuses({name: pp}, self.state.placements)

    def reconcile_all(self) -> None:
        """Every cluster, then placement, then every policy, now, in the caller's thread (tests and the
        fleet benchmark drive the hub this way; the running hub does it through the queue)."""
        with self._lock:
            if not self._synced():
                log.warning("hub informers not synced yet; nothing reconciled")
                return
            for name in sorted(self.informers["clusters"].items()):
                self.reconcile_cluster(name)
            for gone in set(self.state.views) - set(self.informers["clusters"].items()):
                self.reconcile_cluster(gone)
            self.reconcile_placement()
            for name in sorted(self.informers["policies"].items()):
                self.reconcile_policy(name)

    # ------------------------------------------------------------ life

    def warm(self) -> None:
        """Open every watch the reconcilers need without running them (a standby's caches; writes nothing)."""
        with self._lock:
            if self._synced():
                self.links.connect(self.clusters.specs(self.informers["clusters"].items(), report=False),
                                   time.monotonic())

    def close(self) -> None:
        for informer in self.informers.values():
            informer.stop(timeout=0.1)
        self.links.close()

    def run_forever(self) -> None:
        """The worker, for as long as ``stop`` is not set (start_background's contract): every key queued
        once at start, then events and resyncs."""
        self._hub_informers()
        workers = Workers(self.queue, self.reconcile).start()
        try:
            for name in self.informers["clusters"].items():
                self.queue.add(CLUSTER + name)
            self.queue.add_after(PLACEMENT, MIN_GAP_S)
            self.stop.wait()
        finally:
            workers.stop(timeout=30)
            self.close()
