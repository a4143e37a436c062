"""Autoscaler end to end: real metric servers under load, a real operator process (started through
`embedfleet operator run`), the kmock API server in between.

The runtime pods are played by tests/operator/fake_runtime_metrics.py processes (real HTTP servers
exposing the runtime's metric contract, whose in-flight gauge the test sets), announced to the operator
as Pod objects with ``podIP: 127.0.0.1`` and their port — so the daemon's pod discovery, HTTP scraping,
decision, Deployment patch, status and Events all run for real. kmock has no controllers, so nothing
creates pods when replicas change; the test only checks what the operator asked for.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
from schema_helpers import cr_errors, k8s_model_problems

from conftest import EMBEDDING, KmockCluster, wait_for
from embedfleet.operator.crd import naming
from embedfleet.operator.render import selector_labels

NS = "ml"
HERE = Path(__file__).resolve().parent


class FakePod:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fake_runtime_metrics.py"), "--port", "0"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline().split()[-1])

    def load(self, in_flight: float) -> None:
        url = f"http://127.0.0.1:{self.port}/set"
        httpx.post(url, json={"in_flight": in_flight}, timeout=5).raise_for_status()


@pytest.fixture
def fake_pods() -> Iterator[list[FakePod]]:
    pods = [FakePod(), FakePod()]
    yield pods
    for pod in pods:
        pod.proc.terminate()
        pod.proc.wait(10)


def pod_object(name: str, deployment: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": NS, "labels": selector_labels(deployment, "runtime")},
        "spec": {"containers": [{"name": "runtime", "image": "runtime",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


SPEC: dict[str, Any] = {
    "model": {"source": "https://weights.example/minilm.tar", "digest": "sha256:" + "ab" * 32},
    "runtime": {"maxBatchRequests": 32},
    "autoscaling": {
        "minReplicas": 1,
        "maxReplicas": 6,
        "targetUtilization": 1.0,
        "intervalSeconds": 0.5,
        "stableWindowSeconds": 3,
        "panicWindowSeconds": 1,
        "scaleUp": {"stabilizationWindowSeconds": 0},
        "scaleDown": {"stabilizationWindowSeconds": 2},
    },
}


def embedding(name: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1, "resourceVersion": "1"}
    return {"apiVersion": naming.API_VERSION, "metadata": meta, "spec": copy.deepcopy(SPEC)}


def replicas(cluster: KmockCluster, name: str) -> int | None:
    deployment = cluster.get("apps/v1/deployments", NS, name)
    return None if deployment is None else deployment["spec"].get("replicas")


def events(cluster: KmockCluster, reason: str) -> list[dict[str, Any]]:
    """Events with this reason, read on the emulator's loop (kopf's own events have no name there)."""
    plural = kmock.resource("v1/events")

    def read() -> list[dict[str, Any]]:
        return [
            dict(obj.raw)
            for (res, ns, _), obj in cluster.emulator.objects.items()
            if res == plural and ns == NS and not obj.deleted and obj.raw.get("reason") == reason
        ]

    return cluster.call(read)


def test_scales_up_under_load_then_down_after_the_window(
    kmock_cluster: KmockCluster, operator_process: Any, fake_pods: list[FakePod]
) -> None:
    cluster = kmock_cluster
    operator_process(
        cluster.kubeconfig_path,
        argv=[sys.executable, "-m", "embedfleet.runtime.cli", "operator", "run", "-A",
              "--liveness={liveness}"],
    )
    name = "busy"
    cluster.create(EMBEDDING, NS, embedding(name))
    for i, pod in enumerate(fake_pods):
        cluster.create("v1/pods", NS, pod_object(f"{name}-pod-{i}", name, pod.port))
    assert wait_for(lambda: replicas(cluster, name), what="Deployment rendered") == 1

    # 30 + 20 = 50 in flight, batch 32, utilisation 1.0 -> ceil(50 / 32) = 2 replicas (the design's example).
    fake_pods[0].load(30)
    fake_pods[1].load(20)
    wait_for(lambda: replicas(cluster, name) == 2, timeout=30, what="scale up to 2")
    status = cluster.get(EMBEDDING, NS, name)["status"]  # type: ignore[index]
    assert status["replicas"]["desired"] == 2
    assert status["inFlight"] == 50
    decision = status["lastScaleDecision"]
    assert (decision["fromReplicas"], decision["toReplicas"]) == (1, 2)
    assert decision["reason"].startswith("scale up 1 -> 2")
    assert cr_errors("EmbeddingDeployment", cluster.get(EMBEDDING, NS, name)) == []

    # A burst: 150 in flight -> 5 replicas, in panic mode.
    fake_pods[0].load(100)
    fake_pods[1].load(50)
    wait_for(lambda: replicas(cluster, name) == 5, timeout=30, what="scale up to 5")
    assert cluster.get(EMBEDDING, NS, name)["status"]["lastScaleDecision"]["mode"] == "panic"  # type: ignore[index]

    # Load drops: no immediate collapse, then down to what 10 in flight needs (1) once the windows pass.
    fake_pods[0].load(10)
    fake_pods[1].load(0)
    wait_for(lambda: replicas(cluster, name) == 1, timeout=60, what="scale down to 1")
    final = cluster.get(EMBEDDING, NS, name)
    assert final["status"]["lastScaleDecision"]["reason"].startswith("scale down")  # type: ignore[index]
    assert cr_errors("EmbeddingDeployment", final) == []  # type: ignore[arg-type]

    deployment = cluster.get("apps/v1/deployments", NS, name)
    assert deployment is not None and k8s_model_problems(deployment) == []
    scaled = events(cluster, "Scaled")
    assert len(scaled) >= 3
    assert all(e["involvedObject"]["name"] == name and e["involvedObject"]["kind"] == "EmbeddingDeployment"
               for e in scaled)
    assert any("scale down" in e["message"] for e in scaled)


def test_a_silent_pod_freezes_scaling_and_warns(
    kmock_cluster: KmockCluster, operator_process: Any, fake_pods: list[FakePod]
) -> None:
    cluster = kmock_cluster
    operator_process(cluster.kubeconfig_path)
    name = "flaky"
    cluster.create(EMBEDDING, NS, embedding(name))
    fake_pods[0].load(100)
    cluster.create("v1/pods", NS, pod_object(f"{name}-pod-0", name, fake_pods[0].port))
    wait_for(lambda: replicas(cluster, name) == 4, timeout=30, what="scale up to 4")
    fake_pods[1].proc.terminate()
    fake_pods[1].proc.wait(10)
    cluster.create("v1/pods", NS, pod_object(f"{name}-pod-1", name, fake_pods[1].port))
    fake_pods[0].load(0)
    wait_for(lambda: events(cluster, "SignalUnavailable"), timeout=30, what="SignalUnavailable event")
    # With one pod unreadable the total is unknown: nothing is scaled down on a guess.
    assert replicas(cluster, name) == 4
