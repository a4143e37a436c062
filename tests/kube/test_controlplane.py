"""The harness itself: a real control plane schedules onto kwok nodes and gives pods live IPs."""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys

from tests.kube.controlplane import Cluster, wait_until
from tests.kube.netns import GUARD_RANGE, POD_CIDR, PodNetwork


def test_server_version_and_rbac_are_real(kube_cluster: Cluster) -> None:
    version = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    # A fresh ServiceAccount has no rights: RBAC is enforced, not emulated.
    kube_cluster.kubectl("create", "serviceaccount", "nobody", "-n", "default")
    done = kube_cluster.kubectl("auth", "can-i", "list", "nodes", "--as=system:serviceaccount:default:nobody",
                                check=False)
    assert done.stdout.strip() == "no"


def test_gpu_request_lands_on_gpu_node_and_service_gets_pod_ips(kube_cluster: Cluster, unique: str) -> None:
    ns = f"harness-{unique}"
    kube_cluster.kubectl("create", "namespace", ns)
    kube_cluster.apply({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "gpu", "namespace": ns},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "gpu"}},
            "template": {
                "metadata": {"labels": {"app": "gpu"}},
                "spec": {"containers": [{"name": "c", "image": "example.invalid/none:1",
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
            },
        },
    }, {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "gpu", "namespace": ns},
        "spec": {"selector": {"app": "gpu"}, "ports": [{"port": 80, "targetPort": 8080}]},
    })

    def ready_pods() -> list[dict]:
        pods = kube_cluster.get_json("pods", "-n", ns)["items"]
        return [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in p.get("status", {}).get("conditions", []))]

    pods = wait_until(lambda: len(ready_pods()) == 2 and ready_pods(), 60, "2 Ready GPU pods")
    assert {p["spec"]["nodeName"] for p in pods} <= {"gpu-1", "gpu-2"}
    ips = {p["status"]["podIP"] for p in pods}
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network(POD_CIDR) for ip in ips)

    def slice_ips() -> set[str]:
        slices = kube_cluster.get_json("endpointslices", "-n", ns, "-l", "kubernetes.io/service-name=gpu")
        return {a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]}

    wait_until(lambda: slice_ips() == ips, 60, "EndpointSlice with the pods' IPs")
    kube_cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_pod_ip_reaches_a_process_in_the_pod_network(pod_network: PodNetwork) -> None:
    ip = str(next(ipaddress.ip_network(POD_CIDR).hosts()) + 6)
    server = subprocess.Popen(
        [*pod_network.prefix(), sys.executable, "-m", "http.server", "--bind", ip, "18080"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        import httpx

        def answered() -> bool:
            return httpx.get(f"http://{ip}:18080/", timeout=2).status_code == 200

        assert wait_until(answered, 20, f"http.server on {ip}")
    finally:
        server.terminate()
        server.wait(10)


def test_api_server_restart_keeps_state(fresh_plane) -> None:
    cluster = fresh_plane.add_cluster("restart", nodes=[], controllers=False)
    cluster.kubectl("create", "configmap", "keep", "-n", "default", "--from-literal=a=1")
    cluster.stop_apiserver()
    assert not cluster.ready()
    cluster.start_apiserver()
    assert cluster.get_json("configmap", "keep", "-n", "default")["data"] == {"a": "1"}


def test_pod_ips_outside_the_pod_network_never_leave_the_machine(kube_cluster: Cluster) -> None:
    """Any reserved-range address no test namespace owns fails locally (no route), instead of following
    the default route off this machine."""
    stray = str(ipaddress.ip_network(GUARD_RANGE).network_address + 257)
    with socket.socket() as sock:
        sock.settimeout(5)
        try:
            sock.connect((stray, 8080))
        except OSError as exc:
            assert exc.errno in (113, 101), exc  # EHOSTUNREACH / ENETUNREACH: refused on this host
        else:
            raise AssertionError(f"{stray}:8080 answered: traffic left the test's network")


def test_a_write_that_loses_a_race_with_a_delete_is_told_apart_from_a_404_on_nothing_deleted() -> None:
    """operator_proc.deleted_before: a delete received before the 404'd write was answered excuses it, even
    one received after the write itself (the write read the object, then found it gone); a delete received
    after the answer, or none, does not."""
    from tests.kube.controlplane import AuditEvent
    from tests.kube.operator_proc import deleted_before

    def event(verb: str, code: int, received: float, completed: float = 0.0) -> AuditEvent:
        return AuditEvent(user="u", verb=verb, code=code, uri="", resource="embeddingdeployments",
                          subresource="status" if verb == "patch" else "", namespace="ns", name="d",
                          dry_run=False, received=received, completed=completed)

    write = event("patch", 404, received=10.0, completed=10.5)
    assert deleted_before(write, [event("delete", 200, 9.0), write])
    assert deleted_before(write, [event("delete", 200, 10.2), write]), "a delete under way when it was answered"
    assert not deleted_before(write, [event("delete", 200, 10.6), write]), "deleted only after the answer"
    assert not deleted_before(write, [write]), "never deleted"
    assert not deleted_before(write, [event("delete", 404, 9.0), write]), "a delete that failed"
