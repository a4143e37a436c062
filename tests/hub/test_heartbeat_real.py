"""The spoke's heartbeat on a real API server with RBAC: when its identity may not list nodes, the cached
models it reports are unknown, and it says so (a Lease annotation, one log line, the hub's FleetCluster
Degraded=True) instead of reporting "nothing cached"; once allowed, the report is complete again. The same
for its gateway pods: once it may list them, it asks each for GET /gateway/load and the hub shows the sum on
the FleetCluster (status.gateway)."""

from __future__ import annotations

import base64
import json
import logging
import threading
from pathlib import Path

import httpx
import pytest

from embedfleet.operator.hub.controller import HubController
from embedfleet.operator.kube import Kube, load_client
from embedfleet.operator.spoke.heartbeat import GATEWAY_LOAD_ANNOTATION, LEASE_NAME, PROBLEM_ANNOTATION, Heartbeat
from tests.gateway.conftest import start_gateway, wait_for
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.procs import free_port

NS = "embedfleet-system"
RBAC = "rbac.authorization.k8s.io/v1"


def _degraded(cluster: Cluster, name: str) -> dict:
    fc = cluster.get_json("fleetcluster", name)
    return {c["type"]: c for c in fc["status"]["conditions"]}.get("Degraded") or {}


def _round_until(hub: HubController, cluster: Cluster, status: str) -> dict:
    def done() -> dict | None:
        hub.reconcile_all()
        degraded = _degraded(cluster, "self")
        return degraded if degraded.get("status") == status else None

    return wait_until(done, 20, f"Degraded={status} on the FleetCluster")


def test_a_refused_node_list_is_reported_not_swallowed(fresh_plane: ControlPlane, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    cluster = fresh_plane.add_cluster("spoke", nodes=[], controllers=False)
    cluster.install_crds()
    cluster.kubectl("create", "namespace", NS)
    # The spoke operator's identity: its leases, nothing about nodes (what the chart granted when this broke).
    cluster.kubectl("create", "serviceaccount", "spoke", "-n", NS)
    cluster.kubectl("create", "role", "leases", "-n", NS, "--verb=get,create,patch", "--resource=leases")
    cluster.kubectl("create", "rolebinding", "leases", "-n", NS, "--role=leases", f"--serviceaccount={NS}:spoke")
    spoke_kube = Kube(load_client(cluster.kubeconfig_for(cluster.token_for(NS, "spoke"), tmp_path / "spoke.yaml")))
    beat = Heartbeat(spoke_kube)
    beat.namespace = NS

    # The hub, in-process, reading this spoke (as the admin: this test is about what the heartbeat says).
    cluster.apply(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "self-kubeconfig", "namespace": NS},
         "data": {"kubeconfig": base64.b64encode(cluster.kubeconfig.read_bytes()).decode()}},
        {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "FleetCluster", "metadata": {"name": "self"},
         "spec": {"region": "test-region-1", "connection": {"kubeconfigSecret": {"name": "self-kubeconfig"}}}},
    )
    hub = HubController(Kube(load_client(cluster.kubeconfig)), interval=1, ramp=0)

    with caplog.at_level(logging.INFO, logger="embedfleet.operator.spoke.heartbeat"):
        beat.beat()
        beat.beat()
    annotations = cluster.get_json("lease", LEASE_NAME, "-n", NS)["metadata"]["annotations"]
    problem = annotations.get(PROBLEM_ANNOTATION, "")
    assert "cannot list nodes" in problem and "403" in problem, annotations
    assert "cannot list gateway pods" in problem and GATEWAY_LOAD_ANNOTATION not in annotations, annotations
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "403" in warnings[0].getMessage(), "logged once, not every beat"
    # The hub reads the lease through a watch: a round sees the renewal once the event has arrived.
    degraded = _round_until(hub, cluster, "True")
    assert degraded["status"] == "True" and degraded["reason"] == "HeartbeatIncomplete", degraded
    assert "cannot list nodes" in degraded["message"]

    # A gateway pod (no kubelet here: a real gateway process, the pod's IP set to where it listens) holding
    # two requests for a deployment with no replica.
    gateway = start_gateway("--upstream", f"cold=http://127.0.0.1:{free_port()}", "--hold-timeout", "120")
    held = [threading.Thread(target=lambda i=i: _post(gateway.url, f"t{i}"), daemon=True) for i in range(2)]
    for thread in held:
        thread.start()
    wait_for(lambda: gateway.load()["cold"]["held"] == 2, "2 requests held")
    cluster.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": NS}},
                  {"apiVersion": "v1", "kind": "Pod", "metadata": {
                      "name": "gateway-0", "namespace": NS, "labels": {"embedfleet.dev/component": "gateway"}},
                   "spec": {"automountServiceAccountToken": False,
                            "containers": [{"name": "gateway", "image": "embedfleet/gateway:test"}]}})
    cluster.kubectl("patch", "pod", "gateway-0", "-n", NS, "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}}))
    beat.gateway_port = gateway.port

    # Allowed to list nodes and its gateway pods: the report is complete, the problem gone, the hub says
    # Healthy and shows the gateway load.
    cluster.kubectl("create", "role", "gateway-pods", "-n", NS, "--verb=list", "--resource=pods")
    cluster.kubectl("create", "rolebinding", "gateway-pods", "-n", NS, "--role=gateway-pods",
                    f"--serviceaccount={NS}:spoke")
    cluster.apply(
        {"apiVersion": RBAC, "kind": "ClusterRole", "metadata": {"name": "nodes-read"},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]},
        {"apiVersion": RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": "nodes-read"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "nodes-read"},
         "subjects": [{"kind": "ServiceAccount", "name": "spoke", "namespace": NS}]},
    )
    # The API server's authorizer reads roles and bindings from its own watch: a grant takes effect a moment
    # after it is written. Wait until it has, as the spoke's identity sees it, before the beat that needs it.
    spoke_user = f"--as=system:serviceaccount:{NS}:spoke"
    wait_until(lambda: all(cluster.kubectl("auth", "can-i", "list", what, "-n", NS, spoke_user, check=False)
                           .stdout.strip() == "yes" for what in ("nodes", "pods")), 30, "the new grants in effect")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="embedfleet.operator.spoke.heartbeat"):
        beat.beat()
    annotations = cluster.get_json("lease", LEASE_NAME, "-n", NS)["metadata"]["annotations"]
    assert PROBLEM_ANNOTATION not in annotations, annotations
    load = {"gateways": 1, "unanswered": 0, "held": 2, "inFlight": 2, "coldDeployments": 1}
    assert json.loads(annotations[GATEWAY_LOAD_ANNOTATION]) == load
    assert any("complete again" in r.getMessage() for r in caplog.records)
    degraded = _round_until(hub, cluster, "False")
    status = cluster.get_json("fleetcluster", "self")["status"]
    gateway.stop()
    hub.close()
    assert degraded["status"] == "False" and degraded["reason"] == "Healthy", degraded
    assert status["gateway"] == load, status  # no spec.gatewayUrl: no url


def _post(url: str, text: str) -> None:
    """A request the gateway holds until the test stops it (its answer, an error then, is not the point)."""
    try:
        httpx.post(f"{url}/v1/embeddings", json={"model": "cold", "input": text}, timeout=120)
    except httpx.HTTPError:
        pass
