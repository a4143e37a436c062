"""Exactly one acting operator per cluster: leader election on a coordination.k8s.io Lease.

The same protocol as client-go's ``leaderelection`` (what controller-runtime and the kube-controller-manager
use): a candidate takes the Lease when it is free or its holder stopped renewing for
``leaseDurationSeconds``, the leader renews it every ``retry_period``, and a leader that cannot renew
within ``renew_deadline`` stops acting at once (the process exits; its pod restarts as a candidate).
On a clean shutdown the leader releases the Lease, so a standby takes over in one retry period instead
of one lease duration. Writes go through optimistic concurrency (``resourceVersion``): two candidates
racing for a free Lease cannot both win.

Why not the ``kubernetes`` package's ``leaderelection`` (read at version 37.0): it never releases the Lease
on shutdown, so every rollout of the operator would leave the cluster without an acting leader for a whole
lease duration (tests/hub/test_hub_election_real.py asserts the hand-over at once); and a candidate cannot
be stopped (``acquire`` loops on ``time.sleep`` with no cancel), which a process that must exit on SIGTERM
while standing by needs.

Why not kopf peering: with equal priorities every peer pauses itself (a total outage), peering without
its CRD silently does nothing, and work outside kopf handlers (hub controller, spoke heartbeat) was never
covered by it. A process that is not the leader here does not run kopf at all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from embedfleet.operator.kube import Kube, KubeError, identity

log = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "embedfleet-operator"


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    text = text.replace("Z", "+00:00")
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def format_time(ts: float) -> str:
    """MicroTime as the API server wants it (RFC 3339 with microseconds)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseView:
    """What a Lease says about leadership (its ``spec``)."""

    holder: str
    renew_time: float | None
    duration: int
    transitions: int = 0

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> LeaseView:
        spec = spec or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            renew_time=_parse_time(spec.get("renewTime")),
            duration=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
        )


def decide(lease: LeaseView | None, identity: str, now: float, duration: int) -> tuple[str, dict[str, Any] | None]:
    """One election round. Returns (outcome, Lease spec to write or None).

    outcome: ``create`` (no Lease yet), ``acquire`` (free or expired: take it), ``renew`` (ours), or
    ``follow`` (someone else holds a live Lease: write nothing). Pure, so the rules are tested alone.
    """
    stamp = format_time(now)
    if lease is None:
        return "create", {"holderIdentity": identity, "leaseDurationSeconds": duration,
                          "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0}
    if lease.holder == identity:
        return "renew", {"holderIdentity": identity, "leaseDurationSeconds": duration, "renewTime": stamp}
    expired = lease.renew_time is None or now >= lease.renew_time + max(lease.duration, 1)
    if not lease.holder or expired:
        return "acquire", {"holderIdentity": identity, "leaseDurationSeconds": duration,
                           "acquireTime": stamp, "renewTime": stamp,
                           "leaseTransitions": lease.transitions + 1}
    return "follow", None


def default_identity() -> str:
    """Pod name when running in a pod (the chart sets POD_NAME), else host and PID."""
    return identity()


class LeaderElector:
    """Blocks in `acquire()` until leader, then renews on a daemon thread until `release()`."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str = DEFAULT_LEASE_NAME,
        identity: str | None = None,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("need retry_period < renew_deadline < lease_duration")
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.on_lost = on_lost or self._exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.is_leader = False

    @staticmethod
    def _exit() -> None:
        # Acting on after losing the Lease would mean two writers; stop now, the pod restarts.
        log.error("leader election: lost the lease; exiting so that only one operator acts")
        logging.shutdown()
        os._exit(1)

    def try_once(self) -> bool:
        """One round; True when this process holds the Lease afterwards."""
        live = self.kube.get("Lease", self.name, self.namespace)
        view = LeaseView.from_spec((live or {}).get("spec")) if live is not None else None
        outcome, spec = decide(view, self.identity, time.time(), int(self.lease_duration))
        if outcome == "follow":
            return False
        if outcome == "create":
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
            self.kube.create(body)
        else:
            assert live is not None
            # resourceVersion makes this a compare-and-swap: a racing candidate gets 409 and follows.
            patch = {"metadata": {"resourceVersion": live["metadata"]["resourceVersion"]}, "spec": spec}
            self.kube.patch_merge("Lease", self.name, self.namespace, patch)
        if outcome != "renew":
            log.info("leader election: acquired lease %s/%s as %s", self.namespace, self.name, self.identity)
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait until leader (True), or until `stop` is set (False)."""
        waiting_logged = False
        while not (stop and stop.is_set()):
            try:
                if self.try_once():
                    self.is_leader = True
                    self._thread = threading.Thread(target=self._renew_loop, name="leader-renew", daemon=True)
                    self._thread.start()
                    return True
            except KubeError as exc:
                if exc.status not in (409,):
                    log.warning("leader election: %s", exc)
            except Exception as exc:  # unreachable, TLS, urllib3 retries exhausted: try again later
                log.warning("leader election: API server unreachable: %s", exc)
            if not waiting_logged:
                log.info("leader election: waiting for lease %s/%s (another operator is active)",
                         self.namespace, self.name)
                waiting_logged = True
            (stop or self._stop).wait(self.retry_period)
        return False

    def _renew_loop(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.retry_period):
            try:
                if self.try_once():
                    last_ok = time.monotonic()
                    continue
                log.error("leader election: another process holds lease %s/%s", self.namespace, self.name)
            except Exception as exc:  # any failure (HTTP, TLS, urllib3 retries) is a missed renewal
                log.warning("leader election: renewal failed: %s", exc)
                if time.monotonic() - last_ok < self.renew_deadline:
                    continue
            if self._stop.is_set():
                return
            self.is_leader = False
            self.on_lost()
            return

    def release(self) -> None:
        """Stop renewing and hand the Lease back (a standby takes over at its next round)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.retry_period + 5)
        if not self.is_leader:
            return
        self.is_leader = False
        try:
            live = self.kube.get("Lease", self.name, self.namespace)
            if live and (live.get("spec") or {}).get("holderIdentity") == self.identity:
                patch = {"metadata": {"resourceVersion": live["metadata"]["resourceVersion"]},
                         "spec": {"holderIdentity": None, "renewTime": None, "acquireTime": None}}
                self.kube.patch_merge("Lease", self.name, self.namespace, patch)
                log.info("leader election: released lease %s/%s", self.namespace, self.name)
        except (KubeError, OSError) as exc:
            log.warning("leader election: could not release the lease (it expires by itself): %s", exc)
