"""Exactly one active hub: two hub operator processes of one release, on the real test control plane.

Both run the chart's hub command as the chart's ServiceAccount (one identity, as two pods of the hub's
Deployment would), with different pod names, so each sends its own User-Agent
(``embedfleet-operator/<POD_NAME>``) and the hub's audit log tells them apart. One spoke, with the chart's
hub access. The hub's timing comes from the chart's values (``hub.interval``, ``spoke.heartbeatInterval``,
...), so the flags they render are what sets it.

What is protected: the standby only reads until the operator Lease is free (the Lease, by name, with no
attempt on it while the leader renews, and, as a warm standby, the fleet; never a write); a leader killed
without a word (SIGKILL: no release) is replaced no earlier than the Lease's duration after its last
renewal and not much later, and the new leader goes on reconciling (a spec change on the hub reaches the
spoke); no replica writes before it holds the Lease or after it lost it; a leader stopped gracefully
(SIGTERM) hands the Lease back, so a standby takes over in about one retry period instead of a lease
duration. No identity is refused anything on either cluster. Tests in this module share the fleet and
run in file order.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest

from tests.hub.fleet import ELECTION, SYSTEM, Fleet, embedding, errors, hub_user
from tests.kube.controlplane import AuditEvent, ControlPlane, wait_until
from tests.kube.fixtures import require_control_plane
from tests.kube.operator_proc import OperatorProcess, start_operator

REGION = "eu-west-1"
SPOKE = "eu"
DEPLOYMENT = ("search", "ml")
RELEASE = "ef-hub"
#: The operator Lease of the hub's release (chart helper embedfleet.leaseName).
LEASE = f"{RELEASE}-embedfleet-operator"
LEASE_DURATION = float(ELECTION["leaderElection.leaseDuration"])
RETRY = float(ELECTION["leaderElection.retryPeriod"])
#: Two busy cores: a standby's Lease GET, the API server's answer and a kubectl poll may each lag.
MARGIN = 3.0
#: Chart values, rendered as the operator's timing flags: a 1 s hub round, a 1 s heartbeat.
HUB_TIMING = {"hub.interval": "1", "hub.rampSeconds": "6", "hub.spokeWriteTimeout": "5"}
SPOKE_TIMING = {"spoke.heartbeatInterval": "1", "spoke.leaseDuration": "5"}


def agent(pod: str) -> str:
    """The User-Agent a replica sends (kube.py `user_agent()`), from its pod name."""
    return f"embedfleet-operator/{pod}"


@dataclass
class Hubs:
    """The fleet and its hub replicas by pod name; `timings` collects what the tests measured."""

    fleet: Fleet
    procs: dict[str, OperatorProcess] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def start(self, name: str, *, leader: bool) -> str:
        """A hub replica (pod name `ef-hub-<name>`). A leader is waited for until it holds the Lease; a
        standby until its first Lease reads show in the audit log (it is up, and polling)."""
        sets = {"role": "hub", **ELECTION, **HUB_TIMING}
        proc = start_operator(self.fleet.hub, self.fleet.workdir, release=RELEASE, namespace=SYSTEM, sets=sets,
                              name=name, wait_alive=leader)
        pod = f"{RELEASE}-{name}"
        self.procs[pod] = proc
        assert "--hub-interval=1" in proc.argv, proc.argv  # the timing flag, from the chart value
        if not leader:
            def polling() -> bool:
                assert proc.alive(), proc.log()[-3000:]
                return len(lease_reads(self.fleet.hub.audit(), pod)) >= 2

            wait_until(polling, 60, f"{pod} polling the Lease as a standby")
        return pod

    def lease(self) -> dict[str, Any]:
        return (self.fleet.hub.get_json("lease", LEASE, "-n", SYSTEM) or {}).get("spec") or {}

    def holder(self) -> str:
        return self.lease().get("holderIdentity") or ""

    def wait_holder(self, pod: str, timeout: float) -> dict[str, Any]:
        """The Lease once `pod` holds it (polled by kubectl; times are read from the Lease, not the poll)."""
        spec: dict[str, Any] = {}

        def held() -> bool:
            spec.update(self.lease())
            return spec.get("holderIdentity") == pod

        try:
            wait_until(held, timeout, f"{pod} holding the Lease", interval=0.2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nlease: {spec}\n{self.logs()}") from exc
        return spec

    def logs(self, lines: int = 40) -> str:
        out = [self.fleet.logs(lines)]
        for pod, proc in self.procs.items():
            tail = "\n".join(proc.log().splitlines()[-lines:])
            out.append(f"--- hub replica {pod} (alive={proc.alive()})\n{tail}")
        return "\n".join(out)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


def lease_reads(events: list[AuditEvent], pod: str) -> list[AuditEvent]:
    return [e for e in events if e.user_agent == agent(pod) and e.resource == "leases" and e.verb == "get"]


def non_lease_writes(events: list[AuditEvent], user: str) -> list[AuditEvent]:
    """The operator identity's writes other than leader election: what acting on the fleet writes."""
    return [e for e in events if e.user == user and e.is_write and e.resource != "leases"]


def stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.fixture(scope="module")
def hubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hubs]:
    require_control_plane()
    workdir = tmp_path_factory.mktemp("election")
    plane = ControlPlane.start(workdir / "plane")
    state: Hubs | None = None
    try:
        hub = plane.add_cluster("hub", nodes=[], controllers=False)
        spoke = plane.add_cluster(SPOKE, nodes=[{"name": f"{SPOKE}-cpu-{i}", "region": REGION} for i in (1, 2)])
        fleet = Fleet(plane, workdir, hub, {SPOKE: spoke}, {SPOKE: REGION},
                      values={"hub": HUB_TIMING, SPOKE: SPOKE_TIMING})
        fleet.install(hub, "hub")
        fleet.install(spoke, "spoke", REGION)
        fleet.join(SPOKE)
        fleet.namespace(DEPLOYMENT[1])
        fleet.start_spoke(SPOKE)
        fleet.marks()
        state = Hubs(fleet)
        yield state
    finally:
        if state is not None:
            state.stop()
            state.fleet.stop()
            print(f"\nhub election timings (s): {json.dumps(state.timings)}")
        plane.stop()


def replicas(hubs: Hubs, count: int) -> list[str]:
    """The pods the earlier tests of this module started; skipped (not failed twice) when one of them failed."""
    if len([p for p in hubs.procs.values() if p.alive()]) != count:
        pytest.skip("an earlier test of this module did not leave the hub replicas this test starts from")
    return list(hubs.procs)


def _no_unexpected_errors(hubs: Hubs) -> None:
    """Every cluster's audit log since the marks: no 4xx to the hub replicas' identity (shared), the hub's
    identity on the spoke, or the spoke operator, but the benign ones."""
    fleet = hubs.fleet
    user = next(iter(hubs.procs.values())).user
    found = errors(fleet.hub.audit(), user)
    spoke_events = fleet.spokes[SPOKE].audit()
    found += errors(spoke_events, hub_user(SPOKE)) + errors(spoke_events, fleet.spoke_procs[SPOKE].user)
    assert found == [], "\n".join(found) + "\n" + hubs.logs()


def test_one_hub_acts_and_the_standby_only_reads_the_lease(hubs: Hubs) -> None:
    fleet = hubs.fleet
    a = hubs.start("operator-hub-a", leader=True)
    b = hubs.start("operator-hub-b", leader=False)
    assert hubs.holder() == a

    fleet.hub.apply(embedding(*DEPLOYMENT, replicas=2))
    fleet.wait_settled(*DEPLOYMENT, {SPOKE: 2}, timeout=90)
    assert hubs.procs[b].alive() and hubs.holder() == a

    events = fleet.hub.audit()
    user = hubs.procs[a].user
    assert hubs.procs[b].user == user  # one identity: only the User-Agent tells the replicas apart
    acting = non_lease_writes(events, user)
    assert acting, "the leader wrote no status"
    assert {e.user_agent for e in acting} == {agent(a)}, "\n".join(f"{e} [{e.user_agent}]" for e in acting)
    # The standby reads and never writes: the operator Lease by name, no attempt on it while the leader
    # renews, and (a warm standby, hub/handlers.py) whatever keeps its view of the fleet current.
    standby = [e for e in events if e.user_agent == agent(b)]
    assert {e.verb for e in standby} <= {"get", "list", "watch"}, "\n".join(map(str, standby))
    lease_calls = {(e.verb, e.name, e.code) for e in standby if e.resource == "leases"}
    assert lease_calls == {("get", LEASE, 200)}, lease_calls
    assert len(lease_reads(events, b)) >= 2
    # The leader's own Lease traffic: created once, renewed by patch (resourceVersion-guarded).
    leader_lease = {(e.verb, e.code) for e in events if e.user_agent == agent(a) and e.resource == "leases"}
    assert leader_lease <= {("get", 200), ("get", 404), ("create", 201), ("patch", 200)}, leader_lease
    # On the spoke, where the hub's calls carry a replica's User-Agent, only the leader writes.
    spoke_writers = {e.user_agent for e in fleet.spokes[SPOKE].audit()
                     if e.user == hub_user(SPOKE) and e.is_write and e.user_agent.startswith("embedfleet-operator/")}
    assert spoke_writers <= {agent(a)}, spoke_writers
    _no_unexpected_errors(hubs)


def test_a_killed_leader_is_replaced_after_its_lease_and_the_new_one_reconciles(hubs: Hubs) -> None:
    fleet = hubs.fleet
    a, b = replicas(hubs, 2)
    before = hubs.lease()
    assert before["holderIdentity"] == a
    fleet.marks()

    killed_at = time.time()
    hubs.procs[a].kill()  # SIGKILL: no release, the Lease must expire
    dead_at = time.time()
    last_renewal = stamp(hubs.lease()["renewTime"])  # its last one: the process is gone
    assert hubs.holder() == a, "the standby took over before the Lease expired"
    after = hubs.wait_holder(b, LEASE_DURATION + RETRY + 30)
    acquired = stamp(after["acquireTime"])
    gap, takeover = acquired - last_renewal, acquired - killed_at
    hubs.timings["sigkill_takeover_after_kill"] = round(takeover, 2)
    hubs.timings["sigkill_takeover_after_last_renewal"] = round(gap, 2)
    # Never before the Lease expired (two leaders), and within one retry period after, plus the margin.
    assert LEASE_DURATION - 0.01 <= gap <= LEASE_DURATION + RETRY + MARGIN, (gap, before, after)
    assert takeover <= LEASE_DURATION + RETRY + MARGIN, takeover
    assert after["leaseTransitions"] == int(before.get("leaseTransitions") or 0) + 1

    # The new leader reconciles: a spec change on the hub reaches the spoke, and is reported settled.
    changed_at = time.monotonic()
    fleet.hub.kubectl("patch", "embeddingdeployment", DEPLOYMENT[0], "-n", DEPLOYMENT[1], "--type=merge",
                      "-p", json.dumps({"spec": {"replicas": 3}}))
    fleet.wait_settled(*DEPLOYMENT, {SPOKE: 3}, timeout=60)
    hubs.timings["spec_change_settled_under_new_leader"] = round(time.monotonic() - changed_at, 2)
    events = fleet.hub.audit()
    acting = non_lease_writes(events, hubs.procs[b].user)
    assert acting and {e.user_agent for e in acting} == {agent(b)}, "\n".join(f"{e} [{e.user_agent}]"
                                                                        for e in acting)
    early = [str(e) for e in acting if e.received < acquired]
    assert early == [], "the standby acted before it held the Lease:\n" + "\n".join(early)
    # (the events of watches it had open are written when they end, after its death: judged by arrival)
    late = [str(e) for e in events if e.user_agent == agent(a) and e.received > dead_at + 0.5]
    assert late == [], "the killed leader still called:\n" + "\n".join(late)
    _no_unexpected_errors(hubs)


def test_a_leader_stopped_gracefully_hands_the_lease_over_at_once(hubs: Hubs) -> None:
    fleet = hubs.fleet
    _, b = replicas(hubs, 1)
    assert hubs.holder() == b
    fleet.marks()
    c = hubs.start("operator-hub-c", leader=False)

    stopped_at = time.time()
    code = hubs.procs[b].stop(signal.SIGTERM)
    after = hubs.wait_holder(c, LEASE_DURATION + RETRY + 30)
    handover = stamp(after["acquireTime"]) - stopped_at
    hubs.timings["sigterm_handover_after_stop"] = round(handover, 2)
    assert code == 0, hubs.procs[b].log()[-3000:]
    # b renewed within a retry period before SIGTERM; without a release c could not have taken the Lease
    # before that renewal's expiry, LEASE_DURATION - RETRY after the stop at the earliest.
    assert handover < LEASE_DURATION - RETRY - 0.5, (handover, after)
    released = [e for e in fleet.hub.audit() if e.user_agent == agent(b) and e.resource == "leases"
                and e.verb == "patch"]
    assert released and released[-1].code == 200  # its last Lease write: the release
    # c leads: a spec change on the hub reaches the spoke.
    fleet.hub.kubectl("patch", "embeddingdeployment", DEPLOYMENT[0], "-n", DEPLOYMENT[1], "--type=merge",
                      "-p", json.dumps({"spec": {"replicas": 1}}))
    fleet.wait_settled(*DEPLOYMENT, {SPOKE: 1}, timeout=60)
    # Never two acting hubs: b's last write arrived before c held the Lease, and c's first after.
    acquired = stamp(after["acquireTime"])
    acting = non_lease_writes(fleet.hub.audit(), hubs.procs[c].user)
    agents = {e.user_agent for e in acting}
    assert agent(c) in agents and agents <= {agent(b), agent(c)}, "\n".join(f"{e} [{e.user_agent}]" for e in acting)
    overlap = [f"{e} [{e.user_agent}]" for e in acting
               if (e.user_agent == agent(b)) == (e.received >= acquired)]
    assert overlap == [], "\n".join(overlap)
    _no_unexpected_errors(hubs)
