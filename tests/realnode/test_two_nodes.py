"""Two real nodes: a node that joins a running fleet takes the weights from its peer, the second replica lands
there and starts from that node's own cache, the peers' port refuses whoever lacks the release's key, the
scheduler prefers the node holding a deployment's weights and falls back to the other when it is full, and a
spot node reclaimed under load hands its replica to the other node with no accepted request failed.

realnode-2 (`scripts/realnode.sh join`) is a second kubelet with its own containerd, pod range and mount
namespace on the same machine and control plane; the chart's node cache root is one hostPath on both nodes
and holds each node's own bytes, as two machines' disks would. The tier's bridge CNI does not enforce
NetworkPolicy, so the chart's policy on the peers' port is not in force here: the key is what refuses.
Requests go to pod IPs on the bridge. Nothing asserts a duration: waits are bounded only so a broken step fails.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from embedfleet.operator.crd import naming
from tests.kube.controlplane import wait_until
from tests.realnode.node import (
    GATEWAY_PORT,
    NAMESPACE,
    RUNTIME_PORT,
    SECOND_NODE,
    Load,
    ModelServer,
    RealNode,
    embed,
    is_ready,
    runtime_selector,
)
from tests.realnode.test_user_path import CHART, CHART_VALUES, example, gateway_ip, http_deployment

pytestmark = pytest.mark.timeout(5400)  # the first run builds the node and its images

FIRST_NODE = "realnode-1"
TENANT = "two-nodes"  # a namespace of its own: its cache entries and labels are this module's alone
NAME = "minilm-peer"
PEER_PORT = 8476  # the chart's nodeAgent.peers.port
TEXTS = ["Two nodes, one fleet.", "Weights copied from a peer."]


@dataclass
class Fleet:
    node: RealNode
    origin: ModelServer

    @property
    def label(self) -> str:
        return naming.cache_label_key(self.origin.digest, TENANT)

    def runtimes(self, ready: bool = False, name: str = NAME) -> list[dict[str, Any]]:
        pods = self.node.pods(runtime_selector(name), TENANT)
        return [p for p in pods if is_ready(p)] if ready else pods

    def cached_on(self, node: str) -> bool:
        return (self.node.get("node", node) or {}).get("metadata", {}).get("labels", {}).get(
            self.label) == naming.CACHE_LABEL_READY

    def joined(self) -> bool:
        return self.node.get("node", SECOND_NODE) is not None

    def source(self, node: str) -> dict[str, Any]:
        entry = self.node.node_cache(node) / naming.cache_entry(TENANT, self.origin.digest)
        return json.loads((entry / ".source.json").read_text())

    def agent(self, node: str) -> dict[str, Any]:
        """The chart's node agent on `node`, once Ready (a joining node's agent labels the node with its first
        pass, before its readiness probe has passed)."""
        def ready() -> list[dict[str, Any]]:
            return [p for p in self.node.pods("app.kubernetes.io/name=embedfleet-node-agent", NAMESPACE)
                    if p["spec"].get("nodeName") == node and is_ready(p)]

        return wait_until(ready, 300, f"a Ready node agent on {node}")[0]


@pytest.fixture(scope="module")
def fleet(realnode: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One node serving a model with pre-pull from an http origin (the weights came from there), peers on."""
    origin = ModelServer(tmp_path_factory.mktemp("origin"))
    try:
        done = realnode.helm(
            "upgrade", "--install", "embedfleet", str(CHART), "-n", NAMESPACE, "--create-namespace", *CHART_VALUES,
            "--set", f"platform.cacheRoot={realnode.home / 'nodecache'}", "--set", "nodeAgent.peers.enabled=true",
            "--wait", "--timeout", "10m", timeout=700, check=False)
        assert done.returncode == 0, f"helm install failed: {done.stderr.strip()}\n{realnode.diagnose()}"
        realnode.kubectl("create", "namespace", TENANT)
        doc = http_deployment(NAME, origin.url, origin.digest)
        doc["metadata"]["namespace"] = TENANT
        realnode.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        fleet = Fleet(realnode, origin)
        wait_until(lambda: fleet.runtimes(ready=True), 600, f"{NAME} Ready on {FIRST_NODE}")
        wait_until(lambda: fleet.cached_on(FIRST_NODE), 300, f"the cache label on {FIRST_NODE}")
        yield fleet
    finally:
        realnode.kubectl("delete", "namespace", TENANT, "--ignore-not-found", "--wait=true", timeout=300,
                         check=False)
        realnode.helm("uninstall", "embedfleet", "-n", NAMESPACE, "--wait", "--timeout", "5m", timeout=400,
                      check=False)
        realnode.leave()
        origin.close()


def test_a_joining_node_takes_the_weights_from_its_peer_before_a_replica_lands_there(fleet: Fleet) -> None:
    """The first node's copy came from the origin; realnode-2 joins the running fleet, its agent (the chart's
    DaemonSet) pre-pulls from the first node's agent, verified, and the origin sees no request for it."""
    node = fleet.node
    assert fleet.source(FIRST_NODE)["source"] == "origin"
    from_origin = len(fleet.origin.requests)
    assert from_origin > 0, "the first node's pull never reached the origin"
    node.join()
    wait_until(lambda: fleet.cached_on(SECOND_NODE), 600, f"the cache label on {SECOND_NODE}")
    source = fleet.source(SECOND_NODE)
    first_agent = fleet.agent(FIRST_NODE)["status"]["podIP"]
    assert source["source"] == "peer" and source["from"] == f"http://{first_agent}:{PEER_PORT}", source
    assert len(fleet.origin.requests) == from_origin, fleet.origin.requests[from_origin:]
    placed = {p["spec"].get("nodeName") for p in fleet.runtimes()}
    assert placed == {FIRST_NODE}, f"a replica was placed before it was asked for: {placed}"


def test_the_second_replica_lands_on_the_new_node_and_starts_from_its_own_cache(fleet: Fleet) -> None:
    """Scaled to two, the kube-scheduler places the new replica on realnode-2 (it holds the weights and is
    the emptier node); its init container links the node's entry instead of downloading, and it answers with
    the first replica's vectors."""
    node = fleet.node
    requests_before = len(fleet.origin.requests)
    node.kubectl("patch", "embeddingdeployment", NAME, "-n", TENANT, "--type", "merge", "-p",
                 '{"spec":{"autoscaling":{"minReplicas":2,"maxReplicas":2}}}')
    pods = wait_until(lambda: (r := fleet.runtimes(ready=True)) and len(r) == 2 and r, 600, "two Ready replicas")
    by_node = {p["spec"]["nodeName"]: p for p in pods}
    assert set(by_node) == {FIRST_NODE, SECOND_NODE}, sorted(p["spec"]["nodeName"] for p in pods)
    second = by_node[SECOND_NODE]
    init = second["spec"]["initContainers"][0]["name"]
    log = node.kubectl("logs", "-n", TENANT, second["metadata"]["name"], "-c", init).stdout
    assert "(node cache)" in log, f"the replica on {SECOND_NODE} did not start from its node cache: {log}"
    assert len(fleet.origin.requests) == requests_before, fleet.origin.requests[requests_before:]
    vectors = []
    for name in (FIRST_NODE, SECOND_NODE):
        reply = embed(by_node[name]["status"]["podIP"], RUNTIME_PORT, TEXTS, model="minilm-http")
        assert reply.status_code == 200, reply.text
        vectors.append(np.array([d["embedding"] for d in reply.json()["data"]]))
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-5)


def test_the_peers_port_refuses_a_request_without_the_release_key(fleet: Fleet) -> None:
    """Any pod on the network reaches the agents' port here (no NetworkPolicy enforcement): what it gets
    without the release's signature is a 401 that names nothing, for an entry both nodes hold."""
    if not fleet.cached_on(SECOND_NODE):
        pytest.skip("realnode-2 did not join (the first step failed)")
    entry = naming.cache_entry(TENANT, fleet.origin.digest)
    for node in (FIRST_NODE, SECOND_NODE):
        ip = fleet.agent(node)["status"]["podIP"]
        assert httpx.get(f"http://{ip}:{PEER_PORT}/healthz", timeout=10).status_code == 200
        # well formed, fresh and unseen, signed with a key that is not the release's: only the HMAC refuses it
        forged = {"X-Embedfleet-Peer-Time": str(int(time.time())), "X-Embedfleet-Peer-Nonce": secrets.token_hex(16),
                  "X-Embedfleet-Peer-Signature": secrets.token_hex(32)}
        for headers in ({}, forged):
            for path in (f"/v1/entries/{entry}/manifest", f"/v1/entries/{entry}/files/config.json"):
                reply = httpx.get(f"http://{ip}:{PEER_PORT}{path}", headers=headers, timeout=10)
                assert reply.status_code == 401 and reply.text == "peer credentials required\n", (node, path, reply)


def cpu_millis(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def free_cpu(node: RealNode, name: str) -> int:
    """Allocatable CPU of `name` less its pods' requests (millicores), as the scheduler counts it."""
    allocatable = cpu_millis(node.get("node", name)["status"]["allocatable"]["cpu"])
    pods = node.get("pods", "-A", "--field-selector", f"spec.nodeName={name}")["items"]
    used = sum(cpu_millis(c.get("resources", {}).get("requests", {}).get("cpu", "0")) for p in pods
               if p["status"].get("phase") not in ("Succeeded", "Failed") for c in p["spec"]["containers"])
    return allocatable - used


def test_the_scheduler_prefers_the_node_that_holds_the_weights_and_falls_back_when_it_is_full(fleet: Fleet) -> None:
    """A deployment whose weights are pre-pulled on realnode-1 only (`cache.nodeSelector`): its first replica
    goes there although realnode-2 is emptier (the operator's soft affinity to the cache label); sized so that
    realnode-1 has room for one replica, the second goes to realnode-2 and fetches its weights itself."""
    node = fleet.node
    if not fleet.joined():
        pytest.skip("realnode-2 did not join (the first step failed)")
    node.kubectl("delete", "embeddingdeployment", NAME, "-n", TENANT, "--ignore-not-found", "--wait=true",
                 timeout=300)
    wait_until(lambda: not fleet.runtimes(), 300, f"{NAME}'s pods gone")
    name, tenant = "minilm-pref", "two-nodes-pref"  # a tenant of its own: its cache label is on realnode-1 only
    room = free_cpu(node, FIRST_NODE)
    assert free_cpu(node, SECOND_NODE) > room, "realnode-2 should be the emptier node"
    request = room - 50  # one replica fits on realnode-1, not two
    assert request >= 300, f"realnode-1 has too little room for the step: {room}m"
    doc = http_deployment(name, fleet.origin.url, fleet.origin.digest)
    doc["metadata"]["namespace"] = tenant
    doc["spec"]["cache"]["nodeSelector"] = {"kubernetes.io/hostname": FIRST_NODE}
    doc["spec"]["runtime"] = {**doc["spec"].get("runtime", {}), "resources": {
        "requests": {"cpu": f"{request}m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}}
    node.kubectl("create", "namespace", tenant)
    try:
        # the weights on realnode-1 before the deployment exists (a ModelCache), so its first pod is scheduled
        # with the label already there
        node.kubectl("apply", "-f", "-", input=yaml.safe_dump({
            "apiVersion": "embedfleet.dev/v1alpha1", "kind": "ModelCache",
            "metadata": {"name": "weights", "namespace": tenant},
            "spec": {"model": {"source": fleet.origin.url, "digest": fleet.origin.digest},
                     "nodeSelector": {"kubernetes.io/hostname": FIRST_NODE}}}))
        label = naming.cache_label_key(fleet.origin.digest, tenant)
        wait_until(lambda: node.get("node", FIRST_NODE)["metadata"]["labels"].get(label) == "ready", 300,
                   f"the cache label on {FIRST_NODE}")
        node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        before = len(fleet.origin.requests)
        first = wait_until(lambda: [p for p in node.pods(runtime_selector(name), tenant) if is_ready(p)], 600,
                           f"{name} Ready")
        assert [p["spec"]["nodeName"] for p in first] == [FIRST_NODE], [p["spec"]["nodeName"] for p in first]
        assert node.get("node", SECOND_NODE)["metadata"]["labels"].get(label) is None, "realnode-2 cached it too"
        node.kubectl("patch", "embeddingdeployment", name, "-n", tenant, "--type", "merge", "-p",
                     '{"spec":{"autoscaling":{"minReplicas":2,"maxReplicas":2}}}')
        pods = wait_until(lambda: (r := [p for p in node.pods(runtime_selector(name), tenant) if is_ready(p)])
                          and len(r) == 2 and r, 600, f"two Ready replicas of {name}")
        assert sorted(p["spec"]["nodeName"] for p in pods) == [FIRST_NODE, SECOND_NODE]
        second = next(p for p in pods if p["spec"]["nodeName"] == SECOND_NODE)
        log = node.kubectl("logs", "-n", tenant, second["metadata"]["name"], "-c",
                           second["spec"]["initContainers"][0]["name"]).stdout
        assert "(node cache)" not in log, f"realnode-2 held no entry for {tenant}, yet: {log}"
        assert len(fleet.origin.requests) > before, "the replica on realnode-2 did not download from the origin"
    finally:
        node.kubectl("delete", "namespace", tenant, "--wait=true", timeout=300, check=False)

def test_a_reclaimed_spot_node_hands_its_replica_to_the_other_node_with_no_failed_request(fleet: Fleet) -> None:
    """realnode-2 is the spot pool (docs/spot.md's generic label). A deployment of two replicas, one on spot,
    serves load through the gateway; the node gets the reclaim taint a termination handler would set. The
    operator raises an on-demand stand-in on realnode-1 and, once it is Ready, evicts the spot replica through
    the eviction API (the audit log has it, as the operator's identity), and a SpotFallback Event names the
    node; no accepted request fails."""
    node = fleet.node
    if not fleet.joined():
        pytest.skip("realnode-2 did not join (the first step failed)")
    spot = "minilm-spot"
    node.kubectl("delete", "embeddingdeployment", NAME, "-n", TENANT, "--ignore-not-found", "--wait=true",
                 timeout=300)  # room on the nodes
    wait_until(lambda: not fleet.runtimes(), 300, f"{NAME}'s pods gone")
    node.kubectl("label", "node", SECOND_NODE, "embedfleet.dev/capacity-class=spot", "--overwrite")
    doc = example()
    doc["metadata"].update(name=spot, namespace=TENANT)
    doc["spec"]["autoscaling"].update(minReplicas=2, maxReplicas=2)
    doc["spec"]["spot"] = {"max": 1, "fallback": "onDemand", "returnAfterSeconds": 600}
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    try:
        pods = wait_until(lambda: (r := fleet.runtimes(True, spot)) and len(r) == 2 and r, 600, "two Ready replicas")
        on = {p["spec"]["nodeName"]: p for p in pods}
        assert set(on) == {FIRST_NODE, SECOND_NODE}, sorted(p["spec"]["nodeName"] for p in pods)
        spot_pod = on[SECOND_NODE]["metadata"]["name"]
        with Load(gateway_ip(node), GATEWAY_PORT) as load:
            wait_until(lambda: load.ok >= 20, 120, "the load answered through the gateway")
            node.kubectl("taint", "node", SECOND_NODE, "embedfleet.dev/reclaim=true:NoSchedule")

            def handed_over() -> bool:
                ready = fleet.runtimes(True, spot)
                return len(ready) == 2 and {p["spec"]["nodeName"] for p in ready} == {FIRST_NODE} and not any(
                    p["metadata"]["name"] == spot_pod for p in fleet.runtimes(False, spot))

            wait_until(handed_over, 600, "two Ready replicas on realnode-1 and the spot replica gone")
            served = load.ok
            wait_until(lambda: load.ok > served + 20, 120, "the load answered after the hand-over")
        assert not load.failures, f"accepted requests failed ({dict(load.outcomes)}): {load.failures[:5]}"
        evictions = [e for e in node.audit() if e.resource == "pods" and e.subresource == "eviction"
                     and e.name == spot_pod and e.verb == "create"]
        assert evictions and all(e.user == f"system:serviceaccount:{NAMESPACE}:embedfleet" for e in evictions), \
            [str(e) for e in evictions]
        assert any(e.code in (200, 201) for e in evictions), [str(e) for e in evictions]
        events = node.get("events", "-n", TENANT, "--field-selector", "reason=SpotFallback")["items"]
        assert any(SECOND_NODE in e.get("message", "") for e in events), [e.get("message") for e in events]
    finally:
        node.kubectl("delete", "embeddingdeployment", spot, "-n", TENANT, "--ignore-not-found", "--wait=true",
                     timeout=300, check=False)
        node.kubectl("taint", "node", SECOND_NODE, "embedfleet.dev/reclaim-", check=False)
        node.kubectl("label", "node", SECOND_NODE, "embedfleet.dev/capacity-class-", check=False)


def gateway_count(ip: str, name: str, **labels: str) -> float:
    """A counter of the gateway pod's /metrics, summed over the samples matching `labels` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{ip}:{GATEWAY_PORT}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def test_a_node_lost_under_load_fails_no_request_the_gateway_had_sent_there(fleet: Fleet) -> None:
    """A deployment of two replicas, one per node, serves load through the gateway (on realnode-1). realnode-2
    goes silent mid-load as a machine that lost its power would: its pods' bridge ports down, its containers
    frozen, its kubelet and containerd stopped; no reset reaches the gateway. The gateway finds the replica
    lost (TCP keepalive, docs/gateway.md "Lost replicas") and sends the requests it was waiting on to the other
    replica: no accepted request fails, and the gateway counts them as resent for that reason."""
    node = fleet.node
    if not fleet.joined():
        pytest.skip("realnode-2 did not join (the first step failed)")
    lost = "minilm-lost"
    doc = example()
    doc["metadata"].update(name=lost, namespace=TENANT)
    doc["spec"]["autoscaling"].update(minReplicas=2, maxReplicas=2)
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    restore = None
    try:
        pods = wait_until(lambda: (r := fleet.runtimes(True, lost)) and len(r) == 2 and r, 600, "two Ready replicas")
        assert {p["spec"]["nodeName"] for p in pods} == {FIRST_NODE, SECOND_NODE}, \
            sorted(p["spec"]["nodeName"] for p in pods)
        gateways = [p for p in node.pods("app.kubernetes.io/name=embedfleet-gateway", NAMESPACE) if is_ready(p)]
        assert [p["spec"]["nodeName"] for p in gateways] == [FIRST_NODE], "the gateway must outlive the lost node"
        ip = gateways[0]["status"]["podIP"]
        resent = gateway_count(ip, "embedfleet_gateway_retries_total", reason="lost")
        with Load(ip, GATEWAY_PORT, clients=4) as load:
            wait_until(lambda: load.ok >= 40, 120, "the load answered through the gateway by both replicas")
            restore = node.silence(SECOND_NODE)
            served, cut_at = load.ok, time.monotonic()
            wait_until(lambda: load.ok > served + 40 and time.monotonic() - cut_at > 15, 120,
                       "the load answered by realnode-1 alone")
            restore()
            restore = None
        assert not load.failures, f"accepted requests failed ({dict(load.outcomes)}): {load.failures[:5]}"
        assert gateway_count(ip, "embedfleet_gateway_retries_total", reason="lost") > resent, \
            "no request was in flight on the lost node (the step proves nothing)"
        wait_until(lambda: len(fleet.runtimes(True, lost)) == 2, 300, "realnode-2's replica Ready again")
    finally:
        if restore is not None:
            restore()
        node.kubectl("delete", "embeddingdeployment", lost, "-n", TENANT, "--ignore-not-found", "--wait=true",
                     timeout=300, check=False)
