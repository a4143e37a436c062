"""A wave that fails the drift gate on real runtimes, and the hub's rollback: a hub and two spokes (eu, us) on
the real test control plane (tests/hub/fleet.py), the chart's operator on each, and in eu a stand-in
kubelet (tests/kube/kubelet.py) that starts one real runtime per pod with the pod's ConfigMap environment,
serving a tiny random BERT embedder from a ``file://`` directory on the pod's IP.

The change swaps the weights under a ``compatible`` rollout whose first wave is eu: eu's operator runs a
one-pod candidate, reads the probe of the candidate and of the serving pod, measures the drift and reports
``RolloutBlocked`` ``DriftTooHigh``; the hub sees it in eu's copy, rolls back (eu gets the old identity
again) and never sends the new one to us. (tests/hub/test_waves_real.py covers the other way a wave fails,
a spoke whose gate times out, and a breaking rollout through every wave.)

Pod addresses: every spoke's kwok allocates from the same range (netns.POD_CIDR, from its first address up),
so two spokes would hand out the same IPs. Each spoke's nodes therefore get a ``podCIDR`` of their own
(kwok allocates from a node's podCIDR when it has one): eu the upper half of POD_CIDR, which the test's
network namespace serves and which the session's other cluster (allocating from the bottom) does not reach;
us a range in 198.19/16 that nothing routes (the guard route makes it unreachable at once). us runs no
runtime: it never moves in this scenario, so nothing probes its pods.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from embedfleet.operator.crd import naming
from tests.hub.fleet import Fleet, embedding, errors, hub_user, running_fleet, writes
from tests.kube.background import Background
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.kubelet import RUNTIME_PORT, FakeKubelet
from tests.kube.netns import POD_CIDR, PodNetwork
from tests.tiny_models import bert_embedder

REGIONS = {"eu": "eu-west-1", "us": "us-east-1"}
NAME, NS, SERVED = "search", "ml", "tiny"
REVISION = naming.REVISION_ANNOTATION
#: The gate must outlast a cold runtime start (torch import, model load, start-up probe) on 2 busy cores,
#: or the wave fails by GateTimeout instead of by the measured drift.
ROLLOUT = {"gateTimeoutSeconds": 300,
           "waves": [{"name": "eu-first", "regions": ["eu-west-1"], "soakSeconds": 5},
                     {"name": "us-next", "regions": ["us-east-1"], "soakSeconds": 0}]}
START_S = 240
#: eu's pods: the upper half of this process's pod range (routed into the network namespace).
EU_PODS = list(ipaddress.ip_network(POD_CIDR).subnets(new_prefix=25))[1]
#: us's pods: the same /24 in 198.19/16, which nothing routes (no runtime there, and no collision).
US_PODS = ipaddress.ip_network(POD_CIDR.replace("198.18.", "198.19.", 1))


class History(Background):
    """Every version of one spoke's copy, as a watch delivers them: the spoke's RolloutBlocked lives only
    until the hub's rollback reaches it (a round or two), which a poll could miss."""

    join_s = 30.0

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.versions: list[dict[str, Any]] = []
        super().__init__()

    def run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        api = client.CustomObjectsApi(self.cluster.api_client())
        version: str | None = None
        while not self.stopping.is_set():
            try:
                for event in watch.Watch().stream(
                        api.list_namespaced_custom_object, "embedfleet.dev", "v1alpha1", NS, "embeddingdeployments",
                        field_selector=f"metadata.name={NAME}", resource_version=version, timeout_seconds=5):
                    obj = event["object"]
                    if event["type"] not in ("ADDED", "MODIFIED") or obj.get("kind") != "EmbeddingDeployment":
                        continue
                    version = obj["metadata"]["resourceVersion"]
                    self.versions.append(obj)
                    if self.stopping.is_set():
                        return
            except ApiException as exc:
                if exc.status == 410:  # too old: list again (an intermediate version may be lost; rare)
                    version = None
                else:
                    time.sleep(0.5)
            except Exception:  # the API server busy or restarting: watch again
                time.sleep(0.5)

    def conditions(self, type_: str) -> list[dict[str, Any]]:
        return [c for obj in list(self.versions) for c in (obj.get("status") or {}).get("conditions") or []
                if c.get("type") == type_]

    def annotations(self) -> set[str | None]:
        return {((obj.get("metadata") or {}).get("annotations") or {}).get(REVISION) for obj in list(self.versions)}

    def sources(self) -> set[str | None]:
        return {((obj.get("spec") or {}).get("model") or {}).get("source") for obj in list(self.versions)}


@dataclass
class GateFleet:
    fleet: Fleet
    kubelet: FakeKubelet
    models: dict[str, Path]


def _prepare(fleet: Fleet) -> None:
    """Namespaces, and each spoke's nodes a pod range of its own (set once, before any pod exists)."""
    fleet.namespace(NS)
    for spoke, cidr in (("eu", EU_PODS), ("us", US_PODS)):
        for i in (1, 2):
            fleet.spokes[spoke].kubectl("patch", "node", f"{spoke}-cpu-{i}", "--type=merge", "-p",
                                        json.dumps({"spec": {"podCIDR": str(cidr), "podCIDRs": [str(cidr)]}}))


@pytest.fixture(scope="module")
def gate_fleet(pod_network: PodNetwork, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GateFleet]:
    workdir = tmp_path_factory.mktemp("waves-gate")
    models = {"a": bert_embedder(workdir / "embedder-a", 0), "b": bert_embedder(workdir / "embedder-b", 1)}
    with running_fleet(workdir, REGIONS, prepare=_prepare) as fleet:
        with FakeKubelet(fleet.spokes["eu"], pod_network, NS, naming.INSTANCE_LABEL, workdir,
                         config_env=True) as kubelet:
            yield GateFleet(fleet, kubelet, models)


def _copy(fleet: Fleet, spoke: str) -> dict[str, Any]:
    return fleet.copy(spoke, NAME, NS) or {}


def _identity(fleet: Fleet, spoke: str) -> tuple[str | None, str | None]:
    """(revision annotation, model source) of the spoke's copy: what the hub told it to run."""
    obj = _copy(fleet, spoke)
    return (((obj.get("metadata") or {}).get("annotations") or {}).get(REVISION),
            ((obj.get("spec") or {}).get("model") or {}).get("source"))


def _spoke_status(fleet: Fleet, spoke: str) -> dict[str, Any]:
    return _copy(fleet, spoke).get("status") or {}


def _rollout(fleet: Fleet) -> dict[str, Any]:
    return (fleet.hub_object(NAME, NS).get("status") or {}).get("rollout") or {}


def _pod_ips(spoke: Cluster, revision: str) -> set[str]:
    pods = spoke.get_json("pods", "-n", NS, "-l", f"{naming.INSTANCE_LABEL}={NAME},{naming.REVISION_LABEL}={revision}")
    return {p["status"]["podIP"] for p in (pods or {}).get("items") or []
            if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")}


def _embed(ip: str) -> httpx.Response | None:
    try:
        return httpx.post(f"http://{ip}:{RUNTIME_PORT}/v1/embeddings", json={"model": SERVED, "input": "hello"},
                          timeout=30)
    except httpx.HTTPError:
        return None


def _wait(fleet: Fleet, predicate: Any, what: str, timeout: float = 60) -> Any:
    try:
        return wait_until(predicate, timeout, what, interval=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nhub status: {json.dumps(fleet.hub_object(NAME, NS).get('status'))}\n"
                             f"eu: {_identity(fleet, 'eu')} {json.dumps(_spoke_status(fleet, 'eu'))}\n"
                             f"us: {_identity(fleet, 'us')}\n{fleet.logs()}") from exc


def test_a_wave_that_fails_the_drift_gate_rolls_back(gate_fleet: GateFleet) -> None:
    fleet, models = gate_fleet.fleet, gate_fleet.models
    old_source, new_source = f"file://{models['a']}", f"file://{models['b']}"
    eu = fleet.spokes["eu"]
    fleet.marks()
    fleet.hub.apply(embedding(NAME, NS, replicas=2, placement={"mode": "ActiveActive", "minRegions": 2},
                              model={"source": old_source, "servedModelName": SERVED}, rollout=ROLLOUT,
                              runtime={"image": "ghcr.io/embedfleet/runtime:0.1.0", "drainTimeoutSeconds": 1,
                                       "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}))
    fleet.wait_settled(NAME, NS, {"eu": 1, "us": 1})
    assert _identity(fleet, "eu") == _identity(fleet, "us") == ("r1", old_source)
    # Each spoke's pods in its own range; eu's r1 pod serves r1 from a real runtime.
    (ip,) = _wait(fleet, lambda: _pod_ips(eu, "r1") or None, "eu's r1 pod")
    assert ipaddress.ip_address(ip) in EU_PODS
    us_ips = _pod_ips(fleet.spokes["us"], "r1")
    assert us_ips and all(ipaddress.ip_address(a) in US_PODS for a in us_ips), us_ips
    answer = _wait(fleet, lambda: (a := _embed(ip)) is not None and a.status_code == 200 and a,
                   "eu's r1 runtime to answer", timeout=START_S)
    assert (answer.headers["x-embedfleet-revision"], answer.headers["x-embedfleet-vector-space"]) == ("r1", "r1")

    with History(eu) as eu_history, History(fleet.spokes["us"]) as us_history:
        fleet.hub.kubectl("patch", "embeddingdeployment", NAME, "-n", NS, "--type=merge",
                          "-p", json.dumps({"spec": {"model": {"source": new_source}}}))
        _wait(fleet, lambda: _identity(fleet, "eu") == ("r2", new_source), "eu sent r2")
        # eu gates r2 on a real candidate runtime, measures other weights and blocks; the hub rolls back.
        _wait(fleet, lambda: _rollout(fleet).get("phase") == "RolledBack", "the rollback", timeout=START_S + 120)
        _wait(fleet, lambda: _identity(fleet, "eu") == ("r1", old_source), "eu given r1 back")
        _wait(fleet, lambda: _spoke_status(fleet, "eu").get("rollout", {}).get("phase") == "Idle",
              "eu's operator settled on r1 again")
        time.sleep(2)  # the watches deliver what is written by now

    # What eu's operator measured: r2's gate failed by the cosine it read from the two runtimes.
    r2 = next(r for r in _spoke_status(fleet, "eu")["revisions"] if r["name"] == "r2")
    gate = r2["gate"]
    assert gate["passed"] is False and gate["minCosine"] < 0.999, gate
    cosine = f"{gate['minCosine']:.6f}"
    assert r2["fingerprint"].startswith("sha256:")
    r1 = next(r for r in _spoke_status(fleet, "eu")["revisions"] if r["name"] == "r1")
    assert r1["state"] == "Serving" and r1["fingerprint"] != r2["fingerprint"]
    # ...and what eu's copy reported while it was blocked (gone since: the rollback cleared it).
    blocked = [c for c in eu_history.conditions("RolloutBlocked") if c["status"] == "True"]
    assert blocked, eu_history.conditions("RolloutBlocked")
    assert {c["reason"] for c in blocked} == {"DriftTooHigh"}, blocked
    assert all(cosine in c["message"] and "traffic stays on r1" in c["message"] for c in blocked), blocked
    spoke_events = (eu.get_json("events", "-n", NS) or {}).get("items") or []
    assert any(e["reason"] == "RolloutBlocked" and cosine in e["message"] for e in spoke_events
               if e["involvedObject"]["name"] == NAME), [e["message"] for e in spoke_events]

    # The hub: rolled back, naming eu and the drift it reported; r2 Blocked, r1 still current.
    status = fleet.hub_object(NAME, NS)["status"]
    assert status["rollout"]["phase"] == "RolledBack" and status["rollout"]["revision"] == "r2"
    assert status["currentRevision"] == "r1" and status["queryVectorSpace"] == "r1"
    assert [(r["name"], r["state"]) for r in status["revisions"]] == [("r1", "Serving"), ("r2", "Blocked")]
    condition = fleet.condition(NAME, NS, "RolloutBlocked")
    assert condition["status"] == "True" and condition["reason"] == "RolledBack", condition
    assert "eu (RolloutBlocked: DriftTooHigh" in condition["message"] and cosine in condition["message"], condition
    assert "us (" not in condition["message"]
    assert len(fleet.events(NAME, NS, "RolledBack")) == 1

    # eu runs r1 again (its candidate gone) and its runtime still answers as r1; us never saw r2.
    assert _spoke_status(fleet, "eu")["currentRevision"] == "r1"
    _wait(fleet, lambda: eu.get_json("deployment", f"{NAME}-r2", "-n", NS) is None, "eu's candidate removed")
    answer = _embed(ip)
    assert answer is not None and answer.headers["x-embedfleet-revision"] == "r1"
    assert us_history.versions and us_history.annotations() == {"r1"} and us_history.sources() == {old_source}
    assert {r["name"] for r in _spoke_status(fleet, "us")["revisions"]} == {"r1"}
    assert _identity(fleet, "us") == ("r1", old_source)
    assert _rollout(fleet)["phase"] == "RolledBack"  # the same spec is not tried again
    _wait(fleet, lambda: {n: r.get("revision") for n, r in fleet.rows(NAME, NS).items()} == {"eu": "r1", "us": "r1"},
          "the hub's rows showing r1 on both clusters")

    # Nothing unexpected in any audit log: the hub's identity on each spoke, the operators on their own.
    for spoke in REGIONS:
        assert errors(fleet.spokes[spoke].audit(), hub_user(spoke)) == []
        assert [str(e) for e in fleet.spoke_procs[spoke].unexpected_errors()] == []
    assert errors(fleet.hub.audit(), fleet.hub_proc.user) == []
    # Rolled back and settled, the hub writes nothing more (a handful of its 1 s rounds).
    fleet.marks()
    time.sleep(6)
    assert writes(fleet.hub.audit(), fleet.hub_proc.user) == []
    for spoke in REGIONS:
        assert writes(fleet.spokes[spoke].audit(), hub_user(spoke)) == []
