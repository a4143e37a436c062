"""The borrowed in-flight target on the real control plane, as the chart's operator reports it: an object
that sets only spec.runtime.maxBatchRequests gets Accepted=True with reason Deprecated and one Warning
Event; one that sets spec.autoscaling.inFlightPerReplica gets neither; setting the field clears it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.kube.controlplane import Cluster, wait_until
from tests.operator.real import release, small, wait_condition

RUNTIME = {"image": "ghcr.io/embedfleet/runtime:0.1.0", "maxBatchRequests": 8,
           "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}


def _accepted(obj: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Accepted")


def _reasons(cluster: Cluster, ns: str, name: str) -> list[str]:
    events = cluster.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    return [e["reason"] for e in events]


def test_a_borrowed_batch_is_reported_once_and_the_own_field_is_not(kube_cluster: Cluster, unique: str,
                                                                    tmp_path: Path) -> None:
    cluster = kube_cluster
    with release(cluster, tmp_path, unique) as (_system, proc):
        ns = f"deprecated-{unique}"
        cluster.kubectl("create", "namespace", ns)
        cluster.apply(small("borrowed", ns, runtime=RUNTIME, autoscaling={"maxReplicas": 2}))
        cluster.apply(small("own", ns, runtime=RUNTIME, autoscaling={"maxReplicas": 2, "inFlightPerReplica": 8}))

        borrowed = _accepted(wait_condition(cluster, "borrowed", ns, "Accepted"))
        assert borrowed["reason"] == "Deprecated", borrowed
        assert "spec.runtime.maxBatchRequests (8)" in borrowed["message"]
        assert "until spec.autoscaling.inFlightPerReplica is set" in borrowed["message"]
        own = _accepted(wait_condition(cluster, "own", ns, "Accepted"))
        assert (own["reason"], own["message"]) == ("Valid", "spec accepted")

        wait_until(lambda: "Deprecated" in _reasons(cluster, ns, "borrowed"), 30, "the Deprecated Warning Event")
        wait_condition(cluster, "borrowed", ns, "Available")
        wait_condition(cluster, "own", ns, "Available")
        time.sleep(5)  # further converges (the Deployment becoming ready) repeat no Event
        assert _reasons(cluster, ns, "borrowed").count("Deprecated") == 1
        assert "Deprecated" not in _reasons(cluster, ns, "own")
        (event,) = [e for e in cluster.get_json("events", "-n", ns, "--field-selector",
                                                "involvedObject.name=borrowed")["items"] if e["reason"] == "Deprecated"]
        assert event["type"] == "Warning" and "inFlightPerReplica" in event["message"]

        cluster.kubectl("patch", "embeddingdeployment", "borrowed", "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"autoscaling": {"inFlightPerReplica": 8}}}))
        wait_until(lambda: _accepted(cluster.get_json("ed", "borrowed", "-n", ns))["reason"] == "Valid", 60,
                   "Accepted back to Valid once inFlightPerReplica is set")
        assert proc is not None and proc.unexpected_errors() == []
