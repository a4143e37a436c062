"""Revisions, the drift gate and breaking changes on the real test control plane, with real runtimes.

helm install (standalone) -> the operator as the chart's ServiceAccount -> EmbeddingDeployments serving
tiny random BERT embedders from ``file://`` directories -> a stand-in kubelet starts one real runtime per
pod with the pod's ConfigMap environment (model path, revision, vector space) on the pod's IP inside the
test's network namespace, where the operator reads the runtimes' probes. Three changes:

(a) the same weights copied to another directory: a new identity with identical vectors, so the gate
    passes, the primary rolls to r2 (in r1's vector space) and the candidate goes;
(b) other weights under a compatible change: RolloutBlocked=True DriftTooHigh naming the cosine, and the
    main Service's endpoints stay on r1's pods;
(c) other weights as a breaking change: ``<served>@r2`` answers beside ``<served>`` in another vector
    space until spec.rollout.queryRevision flips the main Service to r2, and r1 drains.

Every scenario ends by reading the audit log: a 4xx the operator did not expect fails it.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.kubelet import RUNTIME_PORT, FakeKubelet
from tests.kube.netns import PodNetwork
from tests.kube.operator_proc import OperatorProcess
from tests.operator.real import condition, operator_writes, release
from tests.tiny_models import bert_embedder

from embedfleet.operator.crd import naming

TAG = "rollout"
USERS = f"users-{TAG}"
SERVED = "tiny"
#: A cold runtime start (torch import, model load, start-up probe) on a busy 2-core machine: a bound.
START_S = 240


@dataclass
class Scenario:
    cluster: Cluster
    operator: OperatorProcess
    kubelet: FakeKubelet
    models: dict[str, Path]


def build_models(root: Path) -> dict[str, Path]:
    """Two tiny random BERT embedders with different weights, and a byte-identical copy of the first."""
    out = {key: bert_embedder(root / f"embedder-{key}", seed) for seed, key in ((0, "a"), (1, "b"))}
    out["a-copy"] = root / "embedder-a-copy"
    shutil.copytree(out["a"], out["a-copy"])
    return out


@pytest.fixture(scope="module")
def scenario(_session_plane: ControlPlane, pod_network: PodNetwork,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    cluster = _session_plane.clusters["main"]
    if not cluster.ready():
        cluster.start_apiserver()
    workdir = tmp_path_factory.mktemp("rollout")
    models = build_models(workdir)
    # Fast gate polls, and a resync every few seconds so the steady state below is converged repeatedly.
    env = {"EMBEDFLEET_GATE_POLL_SECONDS": "1", "EMBEDFLEET_RESYNC_SECONDS": "4"}
    with release(cluster, workdir, TAG, env=env) as (_system, operator):
        assert operator is not None
        cluster.kubectl("create", "namespace", USERS)
        with FakeKubelet(cluster, pod_network, USERS, naming.INSTANCE_LABEL, workdir, config_env=True) as kubelet:
            yield Scenario(cluster, operator, kubelet, models)
        assert operator.alive(), operator.log()[-3000:]


@pytest.fixture
def checked(scenario: Scenario) -> Iterator[Scenario]:
    """The scenario, with the audit log marked before and read after: no unexpected 4xx for the operator."""
    scenario.cluster.audit_mark()
    yield scenario
    errors = scenario.operator.unexpected_errors()
    assert errors == [], "\n".join(map(str, errors)) + "\n" + scenario.operator.log()[-3000:]


def deployment_of(name: str, source: Path) -> dict[str, Any]:
    return {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingDeployment",
            "metadata": {"name": name, "namespace": USERS},
            "spec": {"model": {"source": f"file://{source}", "servedModelName": SERVED},
                     "replicas": 1, "autoscaling": {"enabled": False},
                     "runtime": {"drainTimeoutSeconds": 1,
                                 "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}}}


def status(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get_json("embeddingdeployment", name, "-n", USERS) or {}).get("status") or {}


def revision(cluster: Cluster, name: str, rev: str) -> dict[str, Any] | None:
    return next((r for r in status(cluster, name).get("revisions") or [] if r["name"] == rev), None)


def patch_spec(cluster: Cluster, name: str, spec: dict[str, Any]) -> None:
    cluster.kubectl("patch", "embeddingdeployment", name, "-n", USERS, "--type=merge",
                    "-p", json.dumps({"spec": spec}))


def pod_ips(cluster: Cluster, name: str, rev: str) -> set[str]:
    pods = cluster.get_json("pods", "-n", USERS, "-l", f"{naming.INSTANCE_LABEL}={name},{naming.REVISION_LABEL}={rev}")
    return {p["status"]["podIP"] for p in pods["items"]
            if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")}


def endpoint_ips(cluster: Cluster, service: str) -> set[str]:
    slices = cluster.get_json("endpointslices", "-n", USERS, "-l", f"kubernetes.io/service-name={service}")
    return {a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]}


def serving_r1(scenario: Scenario, name: str) -> str:
    """Create the deployment; wait until r1 is recorded and its runtime answers. Returns its pod IP."""
    cluster = scenario.cluster
    cluster.apply(deployment_of(name, scenario.models["a"]))
    r1 = wait_until(lambda: revision(cluster, name, "r1"), 60, f"{name}: r1 recorded")
    st = status(cluster, name)
    assert (st["currentRevision"], st["queryVectorSpace"], r1["state"]) == ("r1", "r1", "Serving")
    assert condition({"status": st}, "RolloutBlocked") == "False"
    (ip,) = wait_until(lambda: pod_ips(cluster, name, "r1") or None, 60, f"{name}: r1's pod")
    # kwok hands a freed pod IP to the next pod at once, and the test kubelet swaps the previous test's runtime
    # on that IP for this pod's a moment later: until then the old one answers, with its own revision.
    answer = wait_until(lambda: (a := _try(embed, ip, SERVED)) is not None and a.status_code == 200
                        and a.headers.get("x-embedfleet-revision") == "r1" and a, START_S,
                        f"{name}: r1's runtime to answer")
    assert answer.headers["x-embedfleet-vector-space"] == "r1"
    return ip


def embed(ip: str, model: str) -> httpx.Response:
    return httpx.post(f"http://{ip}:{RUNTIME_PORT}/v1/embeddings", json={"model": model, "input": "hello"},
                      timeout=30)


def remove(cluster: Cluster, name: str) -> None:
    cluster.kubectl("delete", "embeddingdeployment", name, "-n", USERS, "--wait=true", "--timeout=60s")


def test_compatible_change_with_identical_vectors_passes_the_gate_and_rolls(checked: Scenario) -> None:
    cluster, name = checked.cluster, "compat"
    serving_r1(checked, name)
    patch_spec(cluster, name, {"model": {"source": f"file://{checked.models['a-copy']}"}})
    # Gated first: a one-pod candidate in no vector space, which the main Service does not select.
    candidate = wait_until(lambda: cluster.get_json("deployment", f"{name}-r2", "-n", USERS), 60,
                           "the candidate Deployment")
    labels = candidate["spec"]["template"]["metadata"]["labels"]
    assert labels[naming.VECTOR_SPACE_LABEL] == "ungated" and labels[naming.COMPONENT_LABEL] == "revision"

    def done() -> dict[str, Any] | None:
        st = status(cluster, name)
        states = {r["name"]: r["state"] for r in st.get("revisions") or []}
        return st if states == {"r1": "Retired", "r2": "Serving"} else None

    st = wait_until(done, START_S, "r2 promoted and r1 retired")
    assert (st["currentRevision"], st["queryVectorSpace"]) == ("r2", "r1")
    r2 = next(r for r in st["revisions"] if r["name"] == "r2")
    assert r2["gate"]["passed"] is True and r2["gate"]["minCosine"] >= 0.999
    assert r2["vectorSpace"] == "r1"
    r1 = next(r for r in st["revisions"] if r["name"] == "r1")
    assert r2["fingerprint"] == r1["fingerprint"]  # same weights, same vectors: the same fingerprint
    assert r2["fingerprint"].startswith("sha256:")
    assert r2["source"] == f"file://{checked.models['a-copy']}"
    assert condition({"status": st}, "RolloutBlocked") == "False"
    wait_until(lambda: cluster.get_json("deployment", f"{name}-r2", "-n", USERS) is None, 60, "the candidate gone")
    config = cluster.get_json("configmap", f"{name}-config", "-n", USERS)["data"]
    assert config["EMBEDFLEET_MODEL"] == str(checked.models["a-copy"])
    assert (config["EMBEDFLEET_REVISION"], config["EMBEDFLEET_VECTOR_SPACE"]) == ("r2", "r1")
    # The primary's pod runs r2 now and answers the bare name in r1's space.
    (ip,) = wait_until(lambda: pod_ips(cluster, name, "r2") or None, 60, "the primary's r2 pod")
    answer = wait_until(lambda: (a := _try(embed, ip, SERVED)) is not None and a.status_code == 200 and a,
                        START_S, "the rolled primary pod to answer")
    assert answer.headers["x-embedfleet-revision"] == "r2" and answer.headers["x-embedfleet-vector-space"] == "r1"
    events = cluster.get_json("events", "-n", USERS, "--field-selector", f"involvedObject.name={name}")
    reasons = {e["reason"] for e in events["items"]}
    assert {"RolloutStarted", "RevisionPromoted"} <= reasons
    remove(cluster, name)


def _try(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except httpx.HTTPError:
        return None


def test_compatible_change_of_weights_is_blocked_and_traffic_stays(checked: Scenario) -> None:
    cluster, name = checked.cluster, "blocked"
    serving_r1(checked, name)
    r1_ips = pod_ips(cluster, name, "r1")
    assert r1_ips and wait_until(lambda: endpoint_ips(cluster, name) == r1_ips, 60, "r1 behind the main Service")
    patch_spec(cluster, name, {"model": {"source": f"file://{checked.models['b']}"}})

    def blocked() -> dict[str, Any] | None:
        st = status(cluster, name)
        cond = next((c for c in st.get("conditions") or [] if c["type"] == "RolloutBlocked"), {})
        return st if cond.get("status") == "True" else None

    st = wait_until(blocked, START_S, "RolloutBlocked=True")
    cond = next(c for c in st["conditions"] if c["type"] == "RolloutBlocked")
    r2 = next(r for r in st["revisions"] if r["name"] == "r2")
    assert cond["reason"] == "DriftTooHigh", cond
    assert f"{r2['gate']['minCosine']:.6f}" in cond["message"] and r2["gate"]["minCosine"] < 0.999
    assert r2["state"] == "Blocked" and r2["gate"]["passed"] is False
    assert st["currentRevision"] == "r1" and st["queryVectorSpace"] == "r1" and st["rollout"]["phase"] == "Blocked"
    wait_until(lambda: cluster.get_json("deployment", f"{name}-r2", "-n", USERS) is None, 60, "the candidate removed")
    # Traffic stays on r1: the primary still runs r1 and the main Service's endpoints are r1's pods.
    config = cluster.get_json("configmap", f"{name}-config", "-n", USERS)["data"]
    assert config["EMBEDFLEET_MODEL"] == str(checked.models["a"]) and config["EMBEDFLEET_REVISION"] == "r1"
    assert pod_ips(cluster, name, "r1") == r1_ips and endpoint_ips(cluster, name) == r1_ips
    # Back to r1's identity: the block clears.
    patch_spec(cluster, name, {"model": {"source": f"file://{checked.models['a']}"}})
    wait_until(lambda: condition({"status": status(cluster, name)}, "RolloutBlocked") == "False", 60,
               "RolloutBlocked cleared by reverting the spec")
    remove(cluster, name)


def test_breaking_change_serves_side_by_side_then_flips(checked: Scenario) -> None:
    cluster, name = checked.cluster, "side"
    serving_r1(checked, name)
    patch_spec(cluster, name, {"model": {"source": f"file://{checked.models['b']}"}, "compatibility": "breaking"})
    r2 = wait_until(lambda: (r := revision(cluster, name, "r2")) is not None and r.get("fingerprint") and r,
                    START_S, "r2 side by side with its fingerprint")
    assert r2["state"] == "SideBySide" and r2["vectorSpace"] == "r2" and r2["servedNames"] == [f"{SERVED}@r2"]
    st = status(cluster, name)
    assert (st["currentRevision"], st["queryVectorSpace"], st["rollout"]["phase"]) == ("r1", "r1", "SideBySide")
    service = cluster.get_json("service", f"{name}-r2", "-n", USERS)
    assert service["metadata"]["annotations"][naming.MODEL_ANNOTATION] == f"{SERVED}@r2"
    (r2_ip,) = pod_ips(cluster, name, "r2")
    (r1_ip,) = pod_ips(cluster, name, "r1")
    assert wait_until(lambda: endpoint_ips(cluster, f"{name}-r2") == {r2_ip}, 60, "r2's Service")
    assert endpoint_ips(cluster, name) == {r1_ip}
    new = embed(r2_ip, f"{SERVED}@r2")
    old = embed(r1_ip, SERVED)
    assert new.status_code == 200 and old.status_code == 200, (new.text, old.text)
    assert new.headers["x-embedfleet-vector-space"] == "r2" and old.headers["x-embedfleet-vector-space"] == "r1"
    assert embed(r1_ip, f"{SERVED}@r2").status_code == 404  # r1's replica does not pretend to be r2
    assert new.json()["data"][0]["embedding"] != old.json()["data"][0]["embedding"]

    patch_spec(cluster, name, {"rollout": {"queryRevision": "r2"}})
    # The main Service selects r2's space: first the side pod answers, then the rolled primary.
    wait_until(lambda: (s := cluster.get_json("service", name, "-n", USERS))["spec"]["selector"].get(
        naming.VECTOR_SPACE_LABEL) == "r2" and s, 60, "the main Service flipped to r2")

    def drained() -> dict[str, Any] | None:
        st = status(cluster, name)
        states = {r["name"]: r["state"] for r in st.get("revisions") or []}
        return st if states == {"r1": "Retired", "r2": "Serving"} else None

    st = wait_until(drained, START_S, "r1 drained and retired")
    assert (st["currentRevision"], st["queryVectorSpace"]) == ("r2", "r2")
    wait_until(lambda: cluster.get_json("deployment", f"{name}-r2", "-n", USERS) is None, 60,
               "the side Deployment removed once the primary runs r2")
    assert cluster.get_json("service", f"{name}-r2", "-n", USERS) is None
    wait_until(lambda: not pod_ips(cluster, name, "r1"), 60, "r1's pods gone")
    ips = pod_ips(cluster, name, "r2")
    assert ips and wait_until(lambda: endpoint_ips(cluster, name) == ips, 60, "the main Service on r2's pods")
    events = cluster.get_json("events", "-n", USERS, "--field-selector", f"involvedObject.name={name}")
    assert {"RolloutStarted", "QueriesFlipped"} <= {e["reason"] for e in events["items"]}
    # Done is done: converging again and again (the resync) writes nothing, status included.
    wait_until(lambda: (status(cluster, name).get("replicas") or {}).get("current") == 1, 60,
               "the status to show the one rolled replica")
    time.sleep(2)
    before = len(operator_writes(checked.operator))
    time.sleep(12)
    assert operator_writes(checked.operator)[before:] == []
    keys = ("revisions", "currentRevision", "queryVectorSpace", "rollout")
    assert {k: status(cluster, name)[k] for k in keys} == {k: st[k] for k in keys}
    remove(cluster, name)
