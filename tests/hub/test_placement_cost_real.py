"""Cost ranking on the real test control plane: a hub and two CPU spokes (tests/hub/fleet.py), the chart's
operators as the chart's identities. A deployment allowed one cluster goes where its embeddings cost least
by the prior (the cheaper CPU slot), and the hub's ``Placed`` condition says so, with ``prior``; once a
spoke's heartbeat Lease reports a measured throughput for the model, the hub learns it and the status says
the measured cost (a measurement moving a deployment between resource types: tests/hub/test_placement_cost.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from embedfleet.operator.scheduling.learn import annotation, model_identity
from embedfleet.operator.spoke.heartbeat import LEASE_NAME, THROUGHPUT_ANNOTATION
from tests.hub.fleet import SYSTEM, Fleet, embedding, errors, hub_user, running_fleet
from tests.kube.controlplane import wait_until

REGIONS = {"eu": "eu-west-1", "us": "us-east-1"}
PRICES = {"eu": 0.10, "us": 0.20}
NAME = ("cheapest", "ml")


def _prepare(fleet: Fleet) -> None:
    fleet.namespace("ml")
    for name, price in PRICES.items():
        fleet.hub.kubectl("patch", "fleetcluster", name, "--type=merge",
                          "-p", json.dumps({"spec": {"capacity": {"cpuReplicas": 10, "cpuHourlyPrice": price}}}))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("cost"), REGIONS, prepare=_prepare) as fleet:
        yield fleet


def test_placed_where_embeddings_cost_least_and_priced_by_a_measurement(fleet: Fleet) -> None:
    fleet.marks()
    fleet.hub.apply(embedding(*NAME, replicas=2, placement={"maxClusters": 1}))
    fleet.wait_settled(*NAME, {"eu": 2})
    placed = fleet.condition(*NAME, "Placed")["message"]
    assert "placement: eu (cpu, $" in placed and "/M embeddings prior)" in placed, placed
    assert "us excluded: not selected" in placed, placed
    assert any(r.startswith("cpu at $0.10/h") for r in fleet.rows(*NAME)["eu"]["reasons"])

    # The us spoke's runtimes measured 1,000 embeddings/s per busy CPU replica of this model. Throughput is
    # learned per (model, resource type), so it prices both spokes' CPU slots: the status says the measured
    # cost ($0.10/h over 3.6M embeddings an hour: $0.03/M), and the cheaper slot still wins.
    model = fleet.hub_object(*NAME)["spec"]["model"]
    identity = model_identity(model["source"], model.get("revision"))
    fleet.spokes["us"].kubectl("annotate", "lease", LEASE_NAME, "-n", SYSTEM, "--overwrite",
                               f"{THROUGHPUT_ANNOTATION}={annotation([(identity, 'cpu', 1000.0)])}")
    wait_until(lambda: "placement: eu (cpu, $0.03/M embeddings);" in fleet.condition(*NAME, "Placed")["message"],
               30, "the measured cost in Placed")
    assert "$0.03/M embeddings" in fleet.rows(*NAME)["eu"]["reasons"]
    fleet.wait_settled(*NAME, {"eu": 2})
    # The heartbeat keeps beating and leaves the measurement in place.
    wait_until(lambda: fleet.spokes["us"].get_json("lease", LEASE_NAME, "-n", SYSTEM)["spec"]["renewTime"], 10,
               "a renewal")
    lease = fleet.spokes["us"].get_json("lease", LEASE_NAME, "-n", SYSTEM)
    assert THROUGHPUT_ANNOTATION in lease["metadata"]["annotations"]

    assert fleet.hub_proc is not None and fleet.hub_proc.alive(), fleet.logs()
    found = errors(fleet.hub.audit(), fleet.hub_proc.user)
    for name, spoke in fleet.spokes.items():
        events = spoke.audit()
        found += errors(events, hub_user(name)) + errors(events, fleet.spoke_procs[name].user)
    assert found == [], "\n".join(found) + "\n" + fleet.logs()
