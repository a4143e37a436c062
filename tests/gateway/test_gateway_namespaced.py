"""The gateway of a chart installed with `watchNamespaces`, on the real test control plane: it watches only
those namespaces, with only the namespaced rights the chart's RoleBindings give it.

helm install (standalone, `watchNamespaces=[users-gwns]`) -> the operator as the chart's ServiceAccount ->
the gateway as a host process with the chart's own command and args (which carry `--namespace=users-gwns`)
and the token of the chart's gateway ServiceAccount, bound by a RoleBinding in that namespace only (no
ClusterRoleBinding). A deployment in the watched namespace is routed, held and woken through its scale
subresource; one of the same kind in another namespace does not exist for this gateway (404), and the
API server's audit log shows every request of the gateway's identity was namespaced to the watched
namespace and none was refused: a cluster-wide list, or a write outside the scale subresource, would be a
403 there and fail the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.gateway.conftest import GatewayServer
from tests.gateway.test_kubernetes_mode import gateway_argv, start_gateway
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.operator.real import release, small
from tests.procs import free_port

TAG = "gwns"
WATCHED = f"users-{TAG}"
OTHER = f"other-{TAG}"
SETS = {"watchNamespaces[0]": WATCHED}
IN_SCOPE, OUT_OF_SCOPE = "in-scope-model", "out-of-scope-model"
DEADLINE_S = 20  # the held request's own deadline (X-Request-Timeout): no runtime ever answers here


@dataclass
class Scenario:
    cluster: Cluster
    system: str
    gateway: GatewayServer
    gateway_user: str
    argv: list[str]


def deployment(name: str, namespace: str, served: str) -> dict:
    return small(name, namespace, model={"source": "hf://sentence-transformers/all-MiniLM-L6-v2",
                                         "digest": "sha256:" + "ab" * 32, "servedModelName": served},
                 autoscaling={"minReplicas": 0, "maxReplicas": 1, "scaleToZero": True,
                              "scaleToZeroGraceSeconds": 3600, "intervalSeconds": 1})


@pytest.fixture(scope="module")
def scenario(_session_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    cluster = _session_plane.clusters["main"]
    if not cluster.ready():
        cluster.start_apiserver()
    workdir = tmp_path_factory.mktemp("gateway-namespaced")
    with release(cluster, workdir, TAG, sets=SETS) as (system, _operator):
        cluster.kubectl("create", "namespace", OTHER)
        argv, _ = gateway_argv(cluster, f"ef-{TAG}", system, free_port(), SETS)
        gateway, user = start_gateway(cluster, f"ef-{TAG}", system, workdir, SETS)
        try:
            cluster.apply(deployment("watched", WATCHED, IN_SCOPE))
            cluster.apply(deployment("elsewhere", OTHER, OUT_OF_SCOPE))
            wait_until(lambda: f"{WATCHED}/watched" in gateway.load(), 60, "the gateway to see the watched deployment")
            yield Scenario(cluster, system, gateway, user, argv)
        finally:
            gateway.stop()
            cluster.kubectl("delete", "namespace", OTHER, "--wait=false", check=False)


def scale(cluster: Cluster) -> int:
    return int(cluster.get_json("embeddingdeployment", "watched", "-n", WATCHED)["spec"].get("replicas") or 0)


def test_the_chart_scopes_the_gateway_to_the_watched_namespaces(scenario: Scenario) -> None:
    assert f"--namespace={WATCHED}" in scenario.argv
    bindings = scenario.cluster.get_json("rolebindings", "-n", WATCHED)["items"]
    assert any(b["subjects"][0]["name"] == scenario.gateway_user.rsplit(":", 1)[1] for b in bindings)
    cluster_bindings = scenario.cluster.get_json("clusterrolebindings")["items"]
    assert not [b["metadata"]["name"] for b in cluster_bindings
                if any(s.get("name") == scenario.gateway_user.rsplit(":", 1)[1]
                       and s.get("namespace") == scenario.system for s in b.get("subjects") or [])]


def test_a_deployment_outside_the_watched_namespaces_is_not_routed(scenario: Scenario) -> None:
    assert not [key for key in scenario.gateway.load() if key.startswith(f"{OTHER}/")]
    answer = httpx.post(f"{scenario.gateway.url}/v1/embeddings", json={"model": OUT_OF_SCOPE, "input": "hi"},
                        timeout=30)
    assert answer.status_code == 404, answer.text
    assert OUT_OF_SCOPE in answer.text and IN_SCOPE in answer.text  # it names what it does serve


def test_a_request_for_the_watched_deployment_is_held_and_wakes_it(scenario: Scenario) -> None:
    cluster = scenario.cluster
    assert scale(cluster) == 0
    answer = httpx.post(f"{scenario.gateway.url}/v1/embeddings", json={"model": IN_SCOPE, "input": "wake up"},
                        headers={"x-request-timeout": str(DEADLINE_S)}, timeout=DEADLINE_S + 60)
    # Held until its own deadline (nothing plays the kubelet here), then 504; meanwhile it woke the deployment.
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "deadline_exceeded"
    assert scale(cluster) == 1
    wait_until(lambda: cluster.get_json("deployment", "watched", "-n", WATCHED)["spec"]["replicas"] == 1, 60,
               "the operator to scale the Deployment to 1")


def test_every_gateway_request_was_namespaced_and_allowed(scenario: Scenario) -> None:
    events = [e for e in scenario.cluster.audit(since_mark=False) if e.user == scenario.gateway_user]
    assert {e.resource for e in events} >= {"embeddingdeployments", "endpointslices"}
    refused = [str(e) for e in events if 400 <= e.code < 500]
    assert refused == []
    assert {e.namespace for e in events} == {WATCHED}, sorted({(e.verb, e.uri) for e in events
                                                              if e.namespace != WATCHED})
    writes = [e for e in events if e.is_write]
    assert {(e.verb, e.resource, e.subresource, e.name) for e in writes} == {
        ("patch", "embeddingdeployments", "scale", "watched")}
