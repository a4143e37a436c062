"""A hub with two spokes on the real test control plane: three kube-apiservers on one etcd, the spokes
with controllers and kwok nodes (eu-west-1, us-east-1), the chart's operator on each (role hub / spoke) as
the chart's ServiceAccount, the hub reaching each spoke as the identity that spoke's chart grants it
(tests/hub/fleet.py).

Placement by policy and inline spec, status aggregated from what the spokes run; an idle fleet writes
nothing but heartbeats (every cluster's audit log); a refused write to a spoke shows in the hub's status and
as one Event; a spoke's API server stopped fails its replicas over after lease + grace (never out of a
locked region) and, when it returns, its still-running copies are kept: no duplicate objects, no write
storm. Tests in this module share the fleet and run in file order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from tests.hub.fleet import LEASE, Fleet, embedding, errors, hub_identity, hub_user, running_fleet, writes
from tests.kube.controlplane import wait_until

REGIONS = {"eu": "eu-west-1", "us": "us-east-1"}
LOCKED = ("locked", "ml-eu")  # selected by the eu-data PlacementPolicy: RegionLocked to eu-west-1
SPREAD = ("spread", "ml")  # inline: ActiveActive over two regions


def _prepare(fleet: Fleet) -> None:
    fleet.namespace("ml", {"team": "search"})
    fleet.namespace("ml-eu", {"residency": "eu"})
    fleet.hub.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "PlacementPolicy",
                     "metadata": {"name": "eu-data"},
                     "spec": {"namespaceSelector": {"matchLabels": {"residency": "eu"}}, "priority": 10,
                              "mode": "RegionLocked", "regions": ["eu-west-1"]}})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("fleet"), REGIONS, prepare=_prepare) as fleet:
        yield fleet


def test_placement_by_policy_and_status_from_the_spokes(fleet: Fleet) -> None:
    fleet.marks()
    fleet.hub.apply(embedding(*LOCKED, replicas=2),
                    embedding(*SPREAD, replicas=4, placement={"mode": "ActiveActive", "minRegions": 2}))
    fleet.wait_settled(*LOCKED, {"eu": 2})
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})

    hub_obj = fleet.hub_object(*LOCKED)
    assert "PlacementPolicy eu-data" in fleet.condition(*LOCKED, "Accepted")["message"]
    assert fleet.condition(*LOCKED, "Available")["status"] == "True"
    assert hub_obj["status"]["replicas"] == {"desired": 2, "current": 2, "ready": 2}
    row = fleet.rows(*LOCKED)["eu"]
    assert row["region"] == "eu-west-1" and row["lastSeen"] and not row["reasons"][0].startswith("problem")
    copy_ = fleet.copy("eu", *LOCKED)
    assert copy_["metadata"]["labels"]["embedfleet.dev/hub-managed"] == "eu"
    assert copy_["metadata"]["annotations"]["embedfleet.dev/hub-uid"] == hub_obj["metadata"]["uid"]
    assert copy_["spec"].get("placement", {}).get("regions") in (None, [])  # the hub's placement stays home
    assert fleet.copy("us", *LOCKED) is None
    for name in REGIONS:
        fc = fleet.hub.get_json("fleetcluster", name)
        conds = {c["type"]: c["status"] for c in fc["status"]["conditions"]}
        assert conds["Joined"] == conds["Available"] == "True", fc["status"]
        assert fc["status"]["lastHeartbeat"] and fc["status"]["availableSince"]

    # A spoke-side edit of a hub-managed copy is put back.
    fleet.spokes["us"].kubectl("patch", "embeddingdeployment", SPREAD[0], "-n", SPREAD[1], "--type=merge",
                               "-p", json.dumps({"spec": {"replicas": 7}}))
    wait_until(lambda: fleet.copies(*SPREAD).get("us") == 2, 30, "the spoke edit reverted")
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})
    _no_unexpected_errors(fleet)


def test_an_idle_fleet_writes_nothing_but_heartbeats(fleet: Fleet) -> None:
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})
    fleet.wait_quiet()  # the spokes' reports of the last changes are written
    fleet.marks()
    window = 12.0  # a dozen hub rounds and heartbeats
    time.sleep(window)
    hub_writes = writes(fleet.hub.audit(), fleet.hub_proc.user)
    assert hub_writes == [], "the hub wrote in steady state:\n" + "\n".join(hub_writes)
    for name, spoke in fleet.spokes.items():
        events = spoke.audit()
        by_hub = writes(events, hub_user(name))
        assert by_hub == [], f"the hub wrote to {name} in steady state:\n" + "\n".join(by_hub)
        by_spoke = writes(events, fleet.spoke_procs[name].user)
        assert by_spoke == [], f"{name}'s operator wrote in steady state:\n" + "\n".join(by_spoke)
        renewals = [e for e in events if e.user == fleet.spoke_procs[name].user and e.is_write
                    and e.resource == "leases" and e.name == "embedfleet-spoke"]
        assert len(renewals) >= window / 2, f"{name}: heartbeat renewed only {len(renewals)} times"
    reads = [e for e in fleet.spokes["us"].audit() if e.user == hub_user("us")]
    assert {(e.verb, e.resource) for e in reads} <= {("get", "leases"), ("list", "embeddingdeployments")}
    _no_unexpected_errors(fleet)


def test_a_refused_propagation_shows_in_status_and_as_one_event(fleet: Fleet) -> None:
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})
    fleet.marks()
    # The chart's grant to the hub on us loses `patch`.
    role = f"{hub_identity('us')}-access"
    rules = fleet.spokes["us"].get_json("clusterrole", role)["rules"]
    assert [r["resources"] for r in rules] == [["embeddingdeployments"]], rules
    granted = rules[0]["verbs"]
    _set_verbs(fleet, role, [v for v in granted if v != "patch"])
    fleet.hub.kubectl("patch", "embeddingdeployment", SPREAD[0], "-n", SPREAD[1], "--type=merge",
                      "-p", json.dumps({"spec": {"runtime": {"maxBatchRequests": 48}}}))

    def refused() -> bool:
        problem = (fleet.rows(*SPREAD).get("us") or {}).get("reasons", [""])[0]
        return problem.startswith("problem: propagation failed: HTTP 403")

    try:
        wait_until(refused, 30, "the 403 in the us row")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{fleet.hub_object(*SPREAD).get('status')}\n{fleet.logs()}") from exc
    placed, degraded = fleet.condition(*SPREAD, "Placed"), fleet.condition(*SPREAD, "Degraded")
    assert placed["status"] == "False" and placed["reason"] == "PropagationFailed"
    assert degraded["status"] == "True" and degraded["reason"] == "PropagationFailed"
    assert "us: propagation failed: HTTP 403" in degraded["message"] and "patch" in degraded["message"]
    assert fleet.copy("eu", *SPREAD)["spec"]["runtime"]["maxBatchRequests"] == 48  # the other spoke has it
    time.sleep(4)  # more rounds, each retrying and refused
    assert len(fleet.events(*SPREAD, "PropagationFailed")) == 1, "one Event per failure, not per round"
    assert fleet.events(*SPREAD, "PropagationFailed")[0]["type"] == "Warning"

    _set_verbs(fleet, role, granted)
    wait_until(lambda: (fleet.copy("us", *SPREAD) or {}).get("spec", {}).get("runtime", {})
               .get("maxBatchRequests") == 48, 30, "the change reaching us once allowed")
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})
    assert len(fleet.events(*SPREAD, "Propagated")) == 1
    refusals = [e for e in fleet.spokes["us"].audit() if e.user == hub_user("us") and e.code == 403]
    assert refusals and {(e.verb, e.resource) for e in refusals} == {("patch", "embeddingdeployments")}
    _no_unexpected_errors(fleet, spoke_allow={"us": [(403, "patch")]})


PASSIVE = ("passive", "ml")  # inline: ActivePassive, primary us-east-1


def test_active_passive_keeps_its_standby_region_warm_with_no_replica(fleet: Fleet) -> None:
    fleet.marks()
    fleet.hub.apply(embedding(*PASSIVE, replicas=2, cache={"prePull": True},
                              placement={"mode": "ActivePassive", "primaryRegions": ["us-east-1"]}))

    def warm() -> bool:
        standby = fleet.copy("eu", *PASSIVE)
        row = fleet.rows(*PASSIVE).get("eu") or {}
        return (standby is not None and standby["spec"].get("replicas") == 0
                and standby["spec"]["autoscaling"]["enabled"] is False
                and "warm standby" in row.get("reasons", [])
                and fleet.ready_pods("us", *PASSIVE) == 2 and fleet.ready_pods("eu", *PASSIVE) == 0)

    try:
        wait_until(warm, 120, "us serving 2, eu holding a warm copy with 0 replicas")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{fleet.hub_object(*PASSIVE).get('status')}\n{fleet.copies(*PASSIVE)}\n"
                             f"{fleet.logs()}") from exc
    standby = fleet.copy("eu", *PASSIVE)
    assert standby["spec"]["cache"]["prePull"] is True
    assert not (standby["spec"].get("placement") or {}).get("primaryRegions")  # the hub's placement stays there
    # The spoke runs it as any copy: accepted, nothing to run.
    conditions = {c["type"]: c for c in (standby.get("status") or {}).get("conditions") or []}
    assert conditions.get("Accepted", {}).get("status") == "True", standby.get("status")
    assert fleet.condition(*PASSIVE, "Placed")["status"] == "True"
    assert fleet.hub_object(*PASSIVE)["status"]["replicas"]["desired"] == 2  # the warm copy adds none
    fleet.hub.kubectl("delete", "embeddingdeployment", PASSIVE[0], "-n", PASSIVE[1])
    wait_until(lambda: not fleet.copies(*PASSIVE), 60, "both copies removed with the hub object")
    _no_unexpected_errors(fleet)


def test_a_stopped_spoke_fails_over_and_returns_without_churn(fleet: Fleet) -> None:
    fleet.wait_settled(*LOCKED, {"eu": 2})
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})
    uids = {(s, n): fleet.copy(s, n, ns)["metadata"]["uid"] for s, (n, ns) in
            [("eu", LOCKED), ("eu", SPREAD), ("us", SPREAD)]}
    fleet.marks()
    fleet.spokes["eu"].stop_apiserver()

    fleet.wait_failed_over(*SPREAD, gone="eu", to="us", replicas=4, timeout=60)
    wait_until(lambda: fleet.ready_pods("us", *SPREAD) == 4, 60, "4 ready pods on us")
    degraded = fleet.condition(*SPREAD, "Degraded")
    # One region left of minRegions 2: Constrained, and it says why.
    assert degraded["status"] == "True" and degraded["reason"] == "Constrained", degraded
    assert "fewer than minRegions 2" in degraded["message"]
    assert "eu unavailable (LeaseExpired), its replicas moved" in degraded["message"]
    # Region-locked: nothing may go to us; the hub says the replicas are unplaced.
    wait_until(lambda: fleet.condition(*LOCKED, "Placed").get("reason") == "Constrained", 30, "locked unplaced")
    assert "2 replica(s) unplaced" in fleet.condition(*LOCKED, "Placed")["message"]
    assert fleet.copy("us", *LOCKED) is None
    fc = fleet.hub.get_json("fleetcluster", "eu")["status"]
    available = {c["type"]: c for c in fc["conditions"]}["Available"]
    assert available["status"] == "False" and available["reason"] == "LeaseExpired"
    assert "unreachable" in available["message"] and fc.get("availableSince") is None
    # Not on a missed heartbeat: only lease + grace after the last renewal the hub saw (both on its clock).
    waited = _time(available["lastTransitionTime"]) - _time(fc["lastHeartbeat"])
    # (condition times have whole-second resolution; lastHeartbeat has microseconds)
    assert waited >= LEASE["durationSeconds"] + LEASE["graceSeconds"] - 1.0, waited
    assert len(fleet.events(*SPREAD, "Rescheduled")) >= 1

    # The outage wrote what changed (unreachable, in grace, expired, us's pods Ready), not a write a round.
    status_writes: dict[str, list[str]] = {}
    for e in fleet.hub.audit():
        if e.user == fleet.hub_proc.user and e.is_write and e.subresource == "status":
            status_writes.setdefault(e.name, []).append(f"{e.received:.3f} {e.body}")
    most = max(status_writes, key=lambda name: len(status_writes[name]))
    assert len(status_writes[most]) <= 6, f"{most}'s status writes:\n" + "\n".join(status_writes[most])

    # It returns: its copies (with their pods still running) are kept, and us gives back its extra share.
    fleet.marks()
    fleet.spokes["eu"].start_apiserver()
    if not fleet.spoke_procs["eu"].alive():  # it lost its leader lease with its API server; a pod restarts
        fleet.start_spoke("eu")
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})
    fleet.wait_settled(*LOCKED, {"eu": 2})
    after = {(s, n): fleet.copy(s, n, ns)["metadata"]["uid"] for s, (n, ns) in
             [("eu", LOCKED), ("eu", SPREAD), ("us", SPREAD)]}
    assert after == uids, "a copy was deleted and created again"
    assert fleet.copy("us", *LOCKED) is None
    for name, spoke in fleet.spokes.items():
        hub_writes = writes(spoke.audit(), hub_user(name))
        assert not [w for w in hub_writes if " create " in w or " delete " in w], hub_writes
        assert len(hub_writes) <= 2, f"the hub's writes to {name} on its return:\n" + "\n".join(hub_writes)
    # ... and once its return ramp is over (the rows stop saying "returning"), nothing more is written.
    wait_until(lambda: not any("returning" in reason for obj in (LOCKED, SPREAD)
                               for row in fleet.rows(*obj).values() for reason in row.get("reasons", [])),
               30, "the return ramp over")
    time.sleep(2)
    fleet.marks()
    time.sleep(8)
    assert writes(fleet.hub.audit(), fleet.hub_proc.user) == []
    for name, spoke in fleet.spokes.items():
        assert writes(spoke.audit(), hub_user(name)) == [], name
    _no_unexpected_errors(fleet)


def _set_verbs(fleet: Fleet, role: str, verbs: list[str]) -> None:
    patch = [{"op": "replace", "path": "/rules/0/verbs", "value": verbs}]
    fleet.spokes["us"].kubectl("patch", "clusterrole", role, "--type=json", "-p", json.dumps(patch))


def _time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _no_unexpected_errors(fleet: Fleet, spoke_allow: dict[str, list[tuple[int, str]]] | None = None) -> None:
    """Every cluster's audit log since the marks: no 4xx to the operators or the hub's identity that they
    did not expect."""
    assert fleet.hub_proc.alive(), fleet.logs()
    found = errors(fleet.hub.audit(), fleet.hub_proc.user)
    for name, spoke in fleet.spokes.items():
        events = spoke.audit()
        found += errors(events, hub_user(name), (spoke_allow or {}).get(name, ()))
        found += errors(events, fleet.spoke_procs[name].user)
    assert found == [], "\n".join(found) + "\n" + fleet.logs()

