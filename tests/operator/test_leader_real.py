"""Leader election against a real kube-apiserver (the test control plane, API server only), with the faults
that once gave two writers: an API server that stops answering right after a renewal (SIGSTOP: its socket
accepts, nothing answers), and clocks that disagree between machines.

The promise: the leader stops acting before a standby can take the Lease, that is before the Lease's
duration has passed since the leader's last renewal, whatever the API server does; and a candidate never
takes a Lease that was renewed a moment ago, whatever its clock or the holder's says.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.fixtures import require_control_plane

from embedfleet.operator.kube import Kube
from embedfleet.operator.leader import LeaderElector, format_time

NS = "election"
#: Short timings (whole seconds, as a Lease holds): a 6 s lease, a 4 s renew deadline, renewals every 1 s.
TIMING = {"lease_duration": 6.0, "renew_deadline": 4.0, "retry_period": 1.0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_control_plane()
    plane = ControlPlane.start(Path(tmp_path_factory.mktemp("leader")) / "plane")
    try:
        cluster = plane.add_cluster("lease", nodes=[], controllers=False)
        cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        yield cluster
    finally:
        plane.stop()


class Lost:
    """An ``on_lost`` that records when (monotonic) the elector stopped acting, instead of exiting."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.event = threading.Event()

    def __call__(self) -> None:
        self.at = time.monotonic()
        self.event.set()


def elector(cluster: Cluster, lease: str, who: str, on_lost: Lost, **kwargs) -> LeaderElector:
    return LeaderElector(Kube(cluster.api_client()), NS, lease, identity=who, on_lost=on_lost,
                         **{**TIMING, **kwargs})


def holder(cluster: Cluster, lease: str) -> str:
    return ((cluster.get_json("lease", lease, "-n", NS) or {}).get("spec") or {}).get("holderIdentity") or ""


def test_a_candidate_whose_clock_runs_ahead_does_not_take_a_fresh_lease(cluster: Cluster) -> None:
    lost = Lost()
    leader = elector(cluster, "ahead", "leader", lost)
    assert leader.acquire()
    ahead = elector(cluster, "ahead", "ahead", Lost(), wall=lambda: time.time() + 16)
    try:
        for _ in range(4):  # several rounds while the leader renews every second
            assert not ahead.try_once(), "took a Lease renewed a moment ago"
            time.sleep(TIMING["retry_period"])
        assert holder(cluster, "ahead") == "leader"
        assert leader.is_leader and lost.at is None
    finally:
        leader.release()


def test_a_holder_whose_clock_runs_behind_keeps_its_lease(cluster: Cluster) -> None:
    """The holder (on another machine, here written by hand) renews every second, stamping renewTime from
    a clock 16 s behind; a candidate on a correct clock reads each renewTime as 16 s old, past the 6 s
    lease. It must follow while the record keeps changing."""
    kube = Kube(cluster.api_client())
    path = kube.kinds["Lease"].path(NS, "behind")
    kube.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "behind", "namespace": NS},
                 "spec": {"holderIdentity": "slow-clock", "leaseDurationSeconds": 6,
                          "renewTime": format_time(time.time() - 16)}})
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(1.0):
            kube.request("PATCH", path, body={"spec": {"renewTime": format_time(time.time() - 16)}},
                         content_type="application/merge-patch+json")

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    candidate = elector(cluster, "behind", "candidate", Lost())
    try:
        for _ in range(4):
            assert not candidate.try_once(), "took a Lease that its holder renews every second"
            time.sleep(TIMING["retry_period"])
        assert holder(cluster, "behind") == "slow-clock"
    finally:
        stop.set()
        renewer.join(5)
    # Once the holder stops renewing, the candidate takes it after one lease duration of its own clock.
    started = time.monotonic()
    wait_until(candidate.try_once, TIMING["lease_duration"] + 5, "the candidate taking the abandoned Lease",
               interval=TIMING["retry_period"])
    assert time.monotonic() - started >= TIMING["lease_duration"] - TIMING["retry_period"] - 1.5
    assert holder(cluster, "behind") == "candidate"


def test_a_hung_api_server_ends_the_leaders_acting_before_the_lease_can_be_taken(cluster: Cluster) -> None:
    lost = Lost()
    leader = elector(cluster, "hang", "leader", lost)
    assert leader.acquire()
    standby = elector(cluster, "hang", "standby", Lost())
    standby_stop = threading.Event()
    taken: list[float] = []
    waiter = threading.Thread(target=lambda: standby.acquire(standby_stop) and taken.append(time.monotonic()),
                              daemon=True)
    waiter.start()
    apiserver = next(p for p in cluster.procs if p.name.endswith("apiserver"))
    try:
        first = leader.renewed_at
        wait_until(lambda: leader.renewed_at > first, 10, "a renewal")
        os.kill(apiserver.popen.pid, signal.SIGSTOP)
        renewed = leader.renewed_at
        stopped = time.monotonic()
        try:
            # The API server hangs: no renewal can succeed. The leader must stop acting by its renew
            # deadline, and in any case before the lease duration since its last renewal.
            lost.event.wait(TIMING["lease_duration"] + 2)
            assert lost.at is not None, (
                f"still acting {time.monotonic() - renewed:.1f} s after its last renewal "
                f"(lease duration {TIMING['lease_duration']} s)")
            assert lost.at - renewed < TIMING["lease_duration"], (lost.at - renewed)
            assert not leader.is_leader
        finally:
            os.kill(apiserver.popen.pid, signal.SIGCONT)
        assert stopped - renewed < TIMING["retry_period"] + 0.5
        wait_until(lambda: bool(taken), 30, "the standby taking over once the server answers")
        assert taken[0] > lost.at, "the standby acted while the old leader still did"
        assert holder(cluster, "hang") == "standby"
    finally:
        standby_stop.set()
        waiter.join(10)
        standby.release()
        leader.release()


def test_a_deleted_lease_ends_the_leader_before_a_standby_creates_another(cluster: Cluster) -> None:
    """`kubectl delete lease` while a leader renews and a standby waits: the leader stops acting at its
    next round, and the standby creates a new Lease only after a full lease duration of its own clock
    from when it first found the Lease gone, so the two never act together."""
    lost = Lost()
    leader = elector(cluster, "deleted", "leader", lost)
    assert leader.acquire()
    standby = elector(cluster, "deleted", "standby", Lost())
    standby_stop = threading.Event()
    taken: list[float] = []
    waiter = threading.Thread(target=lambda: standby.acquire(standby_stop) and taken.append(time.monotonic()),
                              daemon=True)
    waiter.start()
    try:
        wait_until(lambda: standby._observed is not None and standby._observed.record.holder == "leader", 10,
                   "the standby seeing the held Lease")
        deleting = time.monotonic()  # the standby's first read that finds the Lease gone comes after this
        cluster.kubectl("delete", "lease", "deleted", "-n", NS)
        assert lost.event.wait(TIMING["retry_period"] + 2), "the leader acted on without its Lease"
        assert lost.at is not None and not leader.is_leader
        wait_until(lambda: bool(taken), TIMING["lease_duration"] + 10, "the standby creating a new Lease")
        assert taken[0] > lost.at, "the standby acted while the old leader still did"
        # Counted from the standby's first read that found the Lease gone.
        assert taken[0] - deleting >= TIMING["lease_duration"], taken[0] - deleting
        assert holder(cluster, "deleted") == "standby"
    finally:
        standby_stop.set()
        waiter.join(10)
        standby.release()
        leader.release()


def test_a_write_that_lands_after_the_deadline_does_not_make_a_leader(cluster: Cluster) -> None:
    """The clock jumps past the renew deadline while the write is under way: the round fails (a leader
    that started acting now would race its own watchdog)."""
    now = [time.monotonic()]
    candidate = elector(cluster, "late", "late", Lost(), clock=lambda: now[0])
    request = candidate.kube.request

    def slow(method: str, *args, **kwargs):
        answer = request(method, *args, **kwargs)
        if method in ("POST", "PATCH"):
            now[0] += TIMING["renew_deadline"] + 1
        return answer

    candidate.kube.request = slow  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        candidate.try_once()
    assert not candidate.is_leader


def test_a_release_that_fails_leaves_the_watchdog_armed(cluster: Cluster) -> None:
    """The release PATCH fails: this process is still the Lease's holder, so it must still stop acting at
    its renew deadline (a standby takes the Lease once it expires)."""
    lost = Lost()
    leader = elector(cluster, "release-fails", "leader", lost)
    assert leader.acquire()
    request = leader.kube.request

    def failing(method: str, *args, **kwargs):
        if method == "PATCH":
            raise ConnectionError("the API server went away")
        return request(method, *args, **kwargs)

    leader.kube.request = failing  # type: ignore[method-assign]
    leader.release()
    assert holder(cluster, "release-fails") == "leader"
    assert lost.event.wait(TIMING["renew_deadline"] + 2), "acting on past the renew deadline after a failed release"
    assert lost.at is not None and lost.at - leader.renewed_at < TIMING["lease_duration"]
    assert not leader.is_leader


def test_a_release_that_succeeds_stands_the_watchdog_down(cluster: Cluster) -> None:
    lost = Lost()
    leader = elector(cluster, "released", "leader", lost)
    assert leader.acquire()
    leader.release()
    assert holder(cluster, "released") == ""
    assert not leader.is_leader
    assert not lost.event.wait(TIMING["renew_deadline"] + 1)


def counting(leader: LeaderElector) -> list[str]:
    """The methods of every call the elector makes from now on."""
    calls: list[str] = []
    request = leader.kube.request

    def counted(method: str, *args, **kwargs):
        calls.append(method)
        return request(method, *args, **kwargs)

    leader.kube.request = counted  # type: ignore[method-assign]
    return calls


def test_the_leader_renews_in_one_call_and_reads_again_after_an_edit(cluster: Cluster) -> None:
    """Renewals are one compare-and-swap on the version of the leader's own last write (each call on a slow
    API server takes a share of the renew deadline). An edit by someone else (a label) changes the version:
    that round reads the Lease and still renews, since this process is still its holder."""
    lost = Lost()
    leader = elector(cluster, "one-call", "leader", lost)
    assert leader.acquire()

    def run_of(pattern: list[str], calls: list[str]) -> bool:
        return any(calls[i:i + len(pattern)] == pattern for i in range(len(calls)))

    try:
        calls = counting(leader)
        # Three rounds in a row of one call each (a round whose call timed out on a busy machine reads
        # the Lease in the next: so not every round, but runs of them; the old rounds were GET, PATCH).
        wait_until(lambda: run_of(["PATCH"] * 3, calls), 20, "three one-call renewals in a row")
        count = len(calls)
        cluster.kubectl("label", "lease", "one-call", "-n", NS, "team=platform")
        edited = time.monotonic()
        wait_until(lambda: leader.renewed_at > edited, 10, "a renewal after the edit")
        assert run_of(["PATCH", "GET", "PATCH"], calls[count:]), calls  # refused, read, renewed
        assert holder(cluster, "one-call") == "leader" and leader.is_leader and lost.at is None
    finally:
        leader.release()
    assert holder(cluster, "one-call") == ""


def test_a_lease_taken_by_hand_ends_the_leader_at_its_next_round(cluster: Cluster) -> None:
    """Someone writes another holder into the Lease (a second operator with a wrong lease name fixed by
    hand, say): the one-call renewal is refused, the read shows another holder, and the leader stops."""
    lost = Lost()
    leader = elector(cluster, "taken", "leader", lost)
    assert leader.acquire()
    try:
        cluster.kubectl("patch", "lease", "taken", "-n", NS, "--type=merge", "-p",
                        '{"spec": {"holderIdentity": "intruder"}}')
        assert lost.event.wait(TIMING["renew_deadline"] + 1), "acting on after another process took the Lease"
        assert not leader.is_leader and holder(cluster, "taken") == "intruder"
    finally:
        leader.release()
