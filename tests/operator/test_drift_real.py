"""Probe drift on the real control plane: the operator (as the chart runs it) reads the probe gauges of the
pods it scrapes and sets Degraded=True reason ProbeDrift, then back to False once the probe is in
tolerance again.

Behind each kwok pod's IP (inside the test's network namespace) runs tests/operator/fake_runtime_metrics.py,
a real HTTP server exporting the runtime's metric contract whose probe cosine the test sets. Two
deployments: one with autoscaling on (drift read from the autoscaler's own scrape) and one with it off
(the daemon scrapes for the probe alone).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.netns import PodNetwork
from tests.operator.real import release, small, wait_condition
from tests.procs import ROOT, child_env, spawn, stop_process

FAKE = Path(__file__).resolve().parent / "fake_runtime_metrics.py"
PORT = 8080  # the EmbeddingDeployment's default runtime port (the container port named http)


def _degraded(cluster: Cluster, name: str, ns: str) -> dict:
    obj = cluster.get_json("ed", name, "-n", ns) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Degraded"), {})


@contextmanager
def fake_runtime(net: PodNetwork, ip: str, logs: Path) -> Iterator[str]:
    """A metrics server listening on the pod's IP inside the namespace; yields its base URL."""
    with open(logs / f"fake-{ip}.log", "ab") as log:
        proc = spawn([*net.prefix(), sys.executable, str(FAKE), "--host", ip, "--port", str(PORT)],
                     stdout=log, stderr=log, env=child_env(), cwd=ROOT)
    url = f"http://{ip}:{PORT}"
    try:
        def up() -> bool:
            assert proc.poll() is None, (logs / f"fake-{ip}.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 30, f"the fake runtime on {ip}")
        yield url
    finally:
        stop_process(proc)


def _set(url: str, cosine: float) -> None:
    httpx.post(f"{url}/set", json={"in_flight": 0, "probe_cosine": cosine, "probe_order_kept": 1, "model": "minilm"},
               timeout=5).raise_for_status()


def _pod(cluster: Cluster, name: str, ns: str) -> tuple[str, str]:
    def running() -> tuple[str, str] | None:
        pods = cluster.get_json("pods", "-n", ns, "-l",
                                f"app.kubernetes.io/instance={name},app.kubernetes.io/component=runtime")
        for pod in (pods or {}).get("items", []):
            if pod["status"].get("phase") == "Running" and pod["status"].get("podIP"):
                return pod["metadata"]["name"], pod["status"]["podIP"]
        return None

    return wait_until(running, 90, f"{ns}/{name}'s pod running with an IP")


def test_a_drifted_probe_degrades_the_deployment_and_recovery_clears_it(
        kube_cluster: Cluster, pod_network: PodNetwork, unique: str, tmp_path: Path) -> None:
    cluster = kube_cluster
    with release(cluster, tmp_path, unique) as (_system, proc):
        ns = f"drift-{unique}"
        cluster.kubectl("create", "namespace", ns)
        rollout = {"minCosine": 0.999, "probeIntervalSeconds": 5}
        cluster.apply(small("scaled", ns, rollout=rollout,
                            autoscaling={"minReplicas": 1, "maxReplicas": 1, "intervalSeconds": 1}))
        cluster.apply(small("fixed", ns, rollout=rollout, autoscaling={"enabled": False}, replicas=1))
        wait_condition(cluster, "scaled", ns, "Available")
        wait_condition(cluster, "fixed", ns, "Available")
        pods = {name: _pod(cluster, name, ns) for name in ("scaled", "fixed")}

        with fake_runtime(pod_network, pods["scaled"][1], tmp_path) as scaled_url, \
                fake_runtime(pod_network, pods["fixed"][1], tmp_path) as fixed_url:
            for url in (scaled_url, fixed_url):
                _set(url, 0.9)
            for name in ("scaled", "fixed"):
                pod = pods[name][0]
                cond = wait_until(lambda n=name: (c := _degraded(cluster, n, ns)).get("status") == "True" and c,
                                  90, f"{name}: Degraded=True")
                assert cond["reason"] == "ProbeDrift", cond
                assert pod in cond["message"] and "0.900000" in cond["message"], cond
                drift = cluster.get_json("ed", name, "-n", ns)["status"]["probeDrift"]
                assert drift["drifted"] is True and drift["pods"] == [pod] and drift["minCosine"] == 0.9
                assert drift["checkedAt"]

            for url in (scaled_url, fixed_url):
                _set(url, 1.0)
            for name in ("scaled", "fixed"):
                cond = wait_until(lambda n=name: (c := _degraded(cluster, n, ns)).get("status") == "False" and c,
                                  90, f"{name}: Degraded=False")
                assert cond["reason"] == "Healthy", cond
                drift = cluster.get_json("ed", name, "-n", ns)["status"]["probeDrift"]
                assert drift["drifted"] is False and drift["pods"] == [] and drift["minCosine"] == 1.0

            events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=fixed")
            reasons = [e["reason"] for e in (events or {}).get("items", [])]
            assert "ProbeDrift" in reasons and "ProbeInTolerance" in reasons

        assert proc is not None and proc.unexpected_errors() == []
