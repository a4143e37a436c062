"""Exactly one acting operator per cluster: leader election on a coordination.k8s.io Lease.

The same protocol as client-go's ``leaderelection`` (what controller-runtime and the kube-controller-manager
use): a candidate takes the Lease when it is free or its holder stopped renewing for
``leaseDurationSeconds``, the leader renews it every ``retry_period`` (counted from the last round's
start: `next_round_in`), and a leader that cannot renew
within ``renew_deadline`` stops acting at once (the process exits; its pod restarts as a candidate).
On a clean shutdown the leader releases the Lease, so a standby takes over in one retry period instead
of one lease duration: only once its work has ended (main.py waits for kopf's handler threads and the
background workers, bounded; if they do not end, it exits without releasing and the Lease expires). Until
the release is written, the renew deadline still ends the acting: a release that fails leaves the
watchdog to stop the process at the deadline. Writes go through optimistic concurrency
(``resourceVersion``): two candidates racing for a free Lease cannot both win.

Time, as client-go judges it. A candidate never compares another machine's clock with its own: it
remembers when, on its own monotonic clock, it last saw the Lease record change (its ``spec``: holder,
``renewTime``, ``acquireTime``, duration or ``leaseTransitions``, the record client-go compares; not the
``resourceVersion``, which anyone editing the Lease's labels or annotations changes), and takes a held
Lease only once ``leaseDurationSeconds`` passed since then with no change (`observe`, `decide`).
``renewTime`` is written for people and other tools, never read to decide.
The leader counts its renew deadline from the start of its last successful renewal; every call it makes
(read and write) is bounded by the time left before that deadline and is never retried behind its back
(`without_retries`), and a watchdog ends its acting at the deadline even if a call overran. Since the
deadline is shorter than the lease duration, and a standby's count starts no earlier than the renewal it
saw, the leader has stopped before any standby can take the Lease. A round whose write returns after
the deadline does not count (the process is not made leader, or stops acting).

A deleted Lease. The leader that finds its Lease gone (404 on its read or its write) has lost it and stops
acting at once. A candidate that saw the Lease held and then finds it gone waits a full lease duration,
counted on its own clock from the first read that found it gone, before it creates a new one: the old
holder may still be acting until its next round or its renew deadline. A candidate that never saw the
Lease held (the first start of the cluster, or the Lease was released) creates it at once, as client-go
does.

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

from embedfleet.kit.client import without_retries
from embedfleet.operator.kube import Kube, KubeError, identity

log = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "embedfleet-operator"
#: The shortest time-out given to one call: a call with less time left is not started (the deadline passed).
MIN_CALL_S = 0.05


def format_time(ts: float) -> str:
    """MicroTime as the API server wants it (RFC 3339 with microseconds)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says about leadership (its ``spec``, and its ``resourceVersion``)."""

    holder: str
    renew_time: str  # as written; compared for change only, never read as a time
    duration: int
    transitions: int = 0
    resource_version: str = ""
    acquire_time: str = ""

    @classmethod
    def from_lease(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            renew_time=str(spec.get("renewTime") or ""),
            duration=int(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str((lease.get("metadata") or {}).get("resourceVersion") or ""),
            acquire_time=str(spec.get("acquireTime") or ""),
        )

    def same(self, other: LeaseRecord) -> bool:
        """Whether the leader election record (the spec) is unchanged between the two reads. Metadata is not
        compared: an edit of labels or annotations is no renewal, and must not keep a dead holder's Lease
        from being taken."""
        return (self.holder, self.renew_time, self.acquire_time, self.duration, self.transitions) == (
            other.holder, other.renew_time, other.acquire_time, other.duration, other.transitions)


@dataclass(frozen=True)
class Observed:
    """A Lease record and when (this process's monotonic clock) it was first seen as it is.

    ``missing``: the Lease was gone at that time; ``record`` is then the last one seen before (it held a
    holder), and its duration is how long the candidate waits before creating a new Lease."""

    record: LeaseRecord
    at: float
    missing: bool = False


def observe(previous: Observed | None, record: LeaseRecord | None, now: float) -> Observed | None:
    """The observation after reading ``record`` at ``now``: the previous one while the record is unchanged
    (its time keeps counting), else a new one starting now.

    No Lease (``record`` None): None when no held Lease was seen before (never seen, or last seen free: it
    may be created at once); else a ``missing`` observation counted from the first read that found it gone,
    since its holder may still be acting until it notices."""
    if record is None:
        if previous is None or (not previous.missing and not previous.record.holder):
            return None
        return previous if previous.missing else Observed(previous.record, now, missing=True)
    if previous is not None and not previous.missing and previous.record.same(record):
        return previous
    return Observed(record, now)


def expired(observed: Observed, now: float) -> bool:
    """Whether the holder has not renewed for the Lease's duration, judged on this process's clock alone."""
    return now >= observed.at + max(observed.record.duration, 1)


def renewal(identity: str, duration: int, stamp: str) -> dict[str, Any]:
    """The Lease spec a holder writes to renew."""
    return {"holderIdentity": identity, "leaseDurationSeconds": duration, "renewTime": stamp}


def decide(observed: Observed | None, identity: str, now: float, stamp: str, duration: int,
           leading: bool = False) -> tuple[str, dict[str, Any] | None]:
    """One election round. Returns (outcome, Lease spec to write or None).

    ``now`` is this process's monotonic time (the only clock that decides); ``stamp`` the wall-clock
    ``renewTime``/``acquireTime`` to write; ``leading``: this process is the acting leader (renewing).
    outcome: ``create`` (no Lease, and none held seen, or one seen held went missing a lease duration
    ago), ``acquire`` (free, or unchanged for its duration: take it), ``renew`` (ours), ``lost`` (the
    leader finds its Lease gone: it stops acting at once), or ``follow`` (someone else holds a live Lease,
    or one seen held went missing too recently: write nothing). Pure, so the rules are tested alone.
    """
    if leading and (observed is None or observed.missing):
        return "lost", None
    if observed is None or (observed.missing and expired(observed, now)):
        return "create", {"holderIdentity": identity, "leaseDurationSeconds": duration,
                          "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0}
    if observed.missing:
        return "follow", None
    lease = observed.record
    if lease.holder == identity:
        return "renew", renewal(identity, duration, stamp)
    if not lease.holder or expired(observed, now):
        return "acquire", {"holderIdentity": identity, "leaseDurationSeconds": duration,
                           "acquireTime": stamp, "renewTime": stamp,
                           "leaseTransitions": lease.transitions + 1}
    return "follow", None


def call_timeout(deadline: float, now: float) -> float | None:
    """The time-out of a call started at ``now`` that must end by ``deadline``; None when too little is left."""
    left = deadline - now
    return left if left >= MIN_CALL_S else None


def next_round_in(last_started: float, now: float, retry_period: float) -> float:
    """Seconds until the leader's next renewal round: rounds start every ``retry_period`` counted from the
    last round's start, and at once when that round took longer.

    The renew deadline counts from the start of the last successful renewal, so a round that started
    ``retry_period`` after the previous one *ended* would lose the previous round's whole duration from
    its own budget (``renew_deadline - retry_period - duration``). Counted from the start, a slow API
    server costs the next round only what the slow call took beyond the period: the next round keeps
    ``renew_deadline - max(retry_period, duration)``. A round that takes at least the period is itself
    the wait, so this never loops without pause."""
    return max(0.0, last_started + retry_period - now)


def default_identity() -> str:
    """Pod name when running in a pod (the chart sets POD_NAME), else host and PID."""
    return identity()


class LeaderElector:
    """Blocks in `acquire()` until leader, then renews on a daemon thread until `release()` (or
    `abandon()`). The deadline watchdog stays armed until a release has been written.

    ``clock`` (monotonic seconds) decides every expiry and deadline; ``wall`` (epoch seconds) only stamps
    the times written into the Lease. Both are parameters so that tests can run a candidate whose clock is
    off.
    """

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
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        # The Lease holds whole seconds: the deadline must fall before the duration that is written.
        if not retry_period < renew_deadline < int(lease_duration):
            raise ValueError("need retry_period < renew_deadline < lease_duration (whole seconds)")
        # Calls of our own, never retried by urllib3: a bound on a call must bound the whole call.
        self.kube = Kube(without_retries(kube.client), kinds=kube.kinds)
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.on_lost = on_lost or self._exit
        self.clock = clock
        self.wall = wall
        self._stop = threading.Event()  # stop renewing
        self._released = threading.Event()  # the release was written: the watchdog stands down
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._lost_lock = threading.Lock()
        self._lost = False
        self._observed: Observed | None = None
        #: The Lease's resourceVersion after this process's last write ("": unknown): the leader's renewal
        #: writes against it in one call.
        self._written_version = ""
        #: Monotonic start of the last successful acquisition or renewal: the renew deadline counts from it.
        self.renewed_at = 0.0
        self.is_leader = False

    @staticmethod
    def _exit() -> None:
        # Acting on after losing the Lease would mean two writers; stop now, the pod restarts.
        log.error("leader election: lost the lease; exiting so that only one operator acts")
        logging.shutdown()
        os._exit(1)

    @property
    def deadline(self) -> float:
        return self.renewed_at + self.renew_deadline

    def _path(self) -> str:
        return self.kube.kinds["Lease"].path(self.namespace, self.name)

    def try_once(self, deadline: float | None = None) -> bool:
        """One round; True when this process holds the Lease afterwards. Every call ends by ``deadline``
        (this clock; default: one renew deadline from now); TimeoutError when too little time is left, or
        when the write returns at or after the deadline (the round then does not count)."""
        started = self.clock()
        deadline = started + self.renew_deadline if deadline is None else deadline

        def bound() -> float:
            left = call_timeout(deadline, self.clock())
            if left is None:
                raise TimeoutError("leader election: the renew deadline passed")
            return left

        if self.is_leader and self._written_version and self._renew_in_place(bound, started, deadline):
            return True
        live = self.kube.request("GET", self._path(), allow_404=True, timeout=bound())
        record = LeaseRecord.from_lease(live) if live is not None else None
        self._observed = observe(self._observed, record, self.clock())
        outcome, spec = decide(self._observed, self.identity, self.clock(), format_time(self.wall()),
                               int(self.lease_duration), leading=self.is_leader)
        if outcome == "lost":
            log.error("leader election: lease %s/%s is gone", self.namespace, self.name)
            return False
        if outcome == "follow":
            return False
        if outcome == "create":
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
            written = self.kube.request("POST", self.kube.kinds["Lease"].path(self.namespace), body=body,
                                        timeout=bound())
        else:
            assert live is not None
            # resourceVersion makes this a compare-and-swap: a racing candidate gets 409 and follows.
            written = self._patch(live["metadata"]["resourceVersion"], spec, bound())
        self._wrote(written, started, deadline)
        if outcome != "renew":
            log.info("leader election: acquired lease %s/%s as %s", self.namespace, self.name, self.identity)
        return True

    def _patch(self, version: str, spec: dict[str, Any], timeout: float) -> Any:
        patch = {"metadata": {"resourceVersion": version}, "spec": spec}
        return self.kube.request("PATCH", self._path(), body=patch, content_type="application/merge-patch+json",
                                 timeout=timeout)

    def _wrote(self, written: Any, started: float, deadline: float) -> None:
        """A write landed: it counts (from the round's start) only if it landed before the deadline."""
        if self.clock() >= deadline:  # the write landed, but too late to count: the deadline has passed
            raise TimeoutError("leader election: the renew deadline passed during the write")
        self._written_version = str(((written or {}).get("metadata") or {}).get("resourceVersion") or "")
        if written:
            self._observed = observe(self._observed, LeaseRecord.from_lease(written), self.clock())
        self.renewed_at = started

    def _renew_in_place(self, bound: Callable[[], float], started: float, deadline: float) -> bool:
        """The leader's renewal in one call, as client-go's fast path: a compare-and-swap on the version its
        own last write left. It succeeds only if nobody has touched the Lease since (no other holder, no
        deletion, no edit); a 409 (it changed) falls back to the full round, which reads it and decides.
        One call instead of two matters when the API server is slow: each takes a share of the deadline."""
        spec = renewal(self.identity, int(self.lease_duration), format_time(self.wall()))
        try:
            written = self._patch(self._written_version, spec, bound())
        except KubeError as exc:
            if exc.status != 409:
                raise
            self._written_version = ""
            return False
        self._wrote(written, started, deadline)
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait until leader (True), or until `stop` is set (False)."""
        waiting_logged = False
        while not (stop and stop.is_set()):
            try:
                if self.try_once():
                    self.is_leader = True
                    self._thread = threading.Thread(target=self._renew_loop, name="leader-renew", daemon=True)
                    self._watchdog = threading.Thread(target=self._watch_deadline, name="leader-deadline",
                                                      daemon=True)
                    self._thread.start()
                    self._watchdog.start()
                    return True
            except KubeError as exc:
                if exc.status not in (409,):
                    log.warning("leader election: %s", exc)
            except Exception as exc:  # unreachable, TLS, timed out: try again later
                log.warning("leader election: API server unreachable: %s", exc)
            if not waiting_logged:
                log.info("leader election: waiting for lease %s/%s (another operator is active)",
                         self.namespace, self.name)
                waiting_logged = True
            (stop or self._stop).wait(self.retry_period)
        return False

    def _renew_loop(self) -> None:
        started = self.renewed_at  # the acquiring round's start
        while not self._stop.wait(next_round_in(started, self.clock(), self.retry_period)):
            if self._lost:
                return
            started, deadline = self.clock(), self.deadline
            try:
                if self.try_once(deadline):
                    self._log_slow(started, deadline)
                    continue
                log.error("leader election: lost lease %s/%s (gone, or another process holds it)",
                          self.namespace, self.name)
            except KubeError as exc:
                if exc.status != 404:  # 404: deleted between our read and our write, lost at once
                    log.warning("leader election: renewal failed: %s", exc)
                    if self.clock() < self.deadline:
                        continue
            except Exception as exc:  # any failure (HTTP, TLS, a call out of time) is a missed renewal
                log.warning("leader election: renewal failed: %s", exc)
                if self.clock() < self.deadline:
                    continue
            self._lose()
            return

    def _log_slow(self, started: float, deadline: float) -> None:
        """A renewal that took longer than its retry period is logged with how much was left of the renew
        deadline it had to meet: the early sign of a leader about to lose its Lease (a busy API server or
        process)."""
        now = self.clock()
        if now - started > self.retry_period:
            log.warning("leader election: renewal took %.1f s; %.1f s of the renew deadline were left",
                        now - started, deadline - now)

    def _watch_deadline(self) -> None:
        """Ends the acting at the renew deadline even while a renewal call is still under way."""
        while not self._lost:
            left = self.deadline - self.clock()
            if left <= 0:
                self._lose()
                return
            if self._released.wait(left):
                return

    def _lose(self) -> None:
        with self._lost_lock:
            if self._lost or self._released.is_set():
                return
            self._lost = True
            self.is_leader = False
        self.on_lost()

    def abandon(self) -> None:
        """Stop renewing without handing the Lease back (work may still be under way): it expires a lease
        duration after the last renewal. The watchdog stays armed: if this process lingers, it stops at
        the renew deadline."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.renew_deadline + 1)
        log.warning("leader election: not releasing lease %s/%s (work still under way); it expires by itself",
                    self.namespace, self.name)

    def release(self) -> None:
        """Stop renewing and hand the Lease back (a standby takes over at its next round). Call it only once
        this process's work has ended. Its calls are bounded by the renew deadline; until the release is
        written this process is still the leader, and the watchdog still ends its acting at the deadline."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.renew_deadline + 1)
        if not self.is_leader:
            self._released.set()
            return

        def bound() -> float:
            left = call_timeout(self.deadline, self.clock())
            if left is None:
                raise TimeoutError("the renew deadline passed")
            return left

        try:
            live = self.kube.request("GET", self._path(), allow_404=True, timeout=bound())
            if live and (live.get("spec") or {}).get("holderIdentity") == self.identity:
                patch = {"metadata": {"resourceVersion": live["metadata"]["resourceVersion"]},
                         "spec": {"holderIdentity": None, "renewTime": None, "acquireTime": None}}
                self.kube.request("PATCH", self._path(), body=patch, timeout=bound(),
                                  content_type="application/merge-patch+json")
                log.info("leader election: released lease %s/%s", self.namespace, self.name)
            else:
                log.warning("leader election: lease %s/%s is no longer ours; nothing to release",
                            self.namespace, self.name)
        except Exception as exc:  # HTTP, unreachable, out of time: the Lease then expires by itself
            log.warning("leader election: could not release the lease (it expires by itself; this process "
                        "stops acting at the renew deadline): %s", exc)
            return
        with self._lost_lock:
            self._released.set()
            self.is_leader = False
