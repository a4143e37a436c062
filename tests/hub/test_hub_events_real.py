"""The hub reacts to events and to its own clock, not to a periodic round: a fleet (a hub and spokes eu, us on
the real test control plane, the chart's operators as the chart's identities, tests/hub/fleet.py) whose hub
resync (``hub.interval``) is 300 s, longer than this module runs. A new deployment and a change of it reach
the spokes through the watches; a spoke whose heartbeat stops is judged unavailable when its lease runs out
(its cluster reconcile asked to be looked at again then) and its share fails over, with no resync in
between. The hub's own metrics show its reconcilers (FleetCluster, Placement, PlacementPolicy) and its
work queue. Tests in this module share the fleet and run in file order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest

from tests.hub.fleet import LEASE, Fleet, embedding, errors, hub_user, running_fleet
from tests.kube.controlplane import wait_until

REGIONS = {"eu": "eu-west-1", "us": "us-east-1"}
RESYNC_S = 300
SPREAD = ("spread", "ml")
POLICY = "team-ml"


def _prepare(fleet: Fleet) -> None:
    fleet.namespace("ml", {"team": "ml"})
    fleet.hub.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "PlacementPolicy",
                     "metadata": {"name": POLICY},
                     "spec": {"namespaceSelector": {"matchLabels": {"team": "ml"}}, "priority": 5,
                              "mode": "ActiveActive", "minRegions": 2}})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    values = {"hub": {"hub.interval": str(RESYNC_S), "hub.rampSeconds": "0"}}
    with running_fleet(tmp_path_factory.mktemp("events"), REGIONS, values=values, prepare=_prepare) as fleet:
        started = time.monotonic()
        yield fleet
        assert time.monotonic() - started < RESYNC_S, "the module outlived one resync: it proves nothing"


def _time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_a_new_deployment_and_its_change_are_placed_from_the_watches(fleet: Fleet) -> None:
    fleet.marks()
    fleet.hub.apply(embedding(*SPREAD, replicas=2))
    fleet.wait_settled(*SPREAD, {"eu": 1, "us": 1}, timeout=90)
    fleet.hub.kubectl("patch", "embeddingdeployment", SPREAD[0], "-n", SPREAD[1], "--type=merge",
                      "-p", '{"spec": {"replicas": 4}}')
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2}, timeout=90)
    # The PlacementPolicy's status follows each placement.
    wait_until(lambda: f"{SPREAD[1]}/{SPREAD[0]}" in str(
        (fleet.hub.get_json("placementpolicy", POLICY).get("status") or {}).get("deployments")), 30,
        "the policy's status listing the deployment")
    assert errors(fleet.hub.audit(), fleet.hub_proc.user) == []
    for name, spoke in fleet.spokes.items():
        assert errors(spoke.audit(), hub_user(name)) == []


def test_a_deprecated_field_is_said_on_the_hub_object_once(fleet: Fleet) -> None:
    """The hub's Accepted names a deprecated field the spec relies on, as a spoke's operator does."""
    runtime = {"image": "ghcr.io/embedfleet/runtime:0.1.0", "maxBatchRequests": 48,
               "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}
    fleet.hub.apply(embedding("legacy", SPREAD[1], replicas=1, runtime=runtime,
                              autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 2}))
    wait_until(lambda: fleet.condition("legacy", SPREAD[1], "Accepted").get("reason") == "Deprecated", 60,
               "Accepted reason Deprecated on the hub object")
    accepted = fleet.condition("legacy", SPREAD[1], "Accepted")
    assert accepted["status"] == "True" and "spec.runtime.maxBatchRequests (48)" in accepted["message"]
    time.sleep(3)  # further placement passes say nothing new
    assert len(fleet.events("legacy", SPREAD[1], "Deprecated")) == 1
    fleet.hub.kubectl("delete", "embeddingdeployment", "legacy", "-n", SPREAD[1])


def test_a_silent_spoke_is_judged_when_its_lease_runs_out(fleet: Fleet) -> None:
    fleet.wait_settled(*SPREAD, {"eu": 2, "us": 2})
    fleet.spoke_procs["eu"].stop()  # its heartbeat stops; its API server still answers

    fleet.wait_failed_over(*SPREAD, gone="eu", to="us", replicas=4, timeout=90)
    fc = fleet.hub.get_json("fleetcluster", "eu")["status"]
    available = {c["type"]: c for c in fc["conditions"]}["Available"]
    assert available["status"] == "False" and available["reason"] == "LeaseExpired", available
    # Judged when the lease ran out, on the hub's clock: not earlier, and not at a resync.
    waited = _time(available["lastTransitionTime"]) - _time(fc["lastHeartbeat"])
    assert LEASE["durationSeconds"] + LEASE["graceSeconds"] - 1.0 <= waited < RESYNC_S / 3, waited


def test_the_reconcilers_and_their_queue_are_in_the_hub_metrics(fleet: Fleet) -> None:
    assert fleet.hub_proc is not None and fleet.hub_proc.metrics_port is not None
    port = fleet.hub_proc.metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)

    def value(prefix: str) -> float:
        return sum(v for k, v in samples.items() if k.startswith(prefix))

    for kind in ("FleetCluster", "Placement", "PlacementPolicy"):
        assert value(f'embedfleet_operator_reconcile_seconds_count{{kind="{kind}",result="ok"}}') >= 1, kind
    assert value('embedfleet_operator_workqueue_adds_total{name="hub"}') >= 3
    assert value('embedfleet_operator_workqueue_work_seconds_count{name="hub"}') >= 3
    assert 'embedfleet_operator_workqueue_depth{name="hub"}' in samples
    assert value("embedfleet_operator_hub_round_seconds_count") >= 2
