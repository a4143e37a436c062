"""The operator on a real control plane, as the chart runs it (its command, its ServiceAccount):
the user's path, self-healing, garbage collection, steady state, the scale subresource, GPU rollouts,
and no starvation with many deployments. Every test ends by reading the audit log: a 4xx the operator
did not expect fails it."""

from __future__ import annotations

import json
import re
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.netns import PodNetwork
from tests.operator.real import (
    CHART_ELECTION,
    condition,
    example,
    operator_writes,
    release,
    small,
    wait_condition,
)
from tests.operator.test_drift_real import fake_runtime


def _standalone(cluster: Cluster, unique: str, tmp_path: Path, sets: dict[str, str] | None = None):
    with release(cluster, tmp_path, unique, sets=sets) as (_system_ns, proc):
        ns = f"team-{unique}"
        cluster.kubectl("create", "namespace", ns)
        yield cluster, proc, ns
        assert proc.alive(), proc.log()[-3000:]
        errors = proc.unexpected_errors()
        assert errors == [], "\n".join(map(str, errors)) + "\n" + proc.log()[-3000:]


@pytest.fixture
def standalone(kube_cluster: Cluster, unique: str, tmp_path: Path):
    yield from _standalone(kube_cluster, unique, tmp_path)


@pytest.fixture
def standalone_chart_election(kube_cluster: Cluster, unique: str, tmp_path: Path):
    yield from _standalone(kube_cluster, unique, tmp_path, CHART_ELECTION)


def _deployment(cluster: Cluster, name: str, ns: str) -> dict | None:
    return cluster.get_json("deployment", name, "-n", ns)


def test_example_becomes_available_on_kwok_nodes(standalone) -> None:
    cluster, _proc, ns = standalone
    cluster.apply(example("minilm", ns))
    obj = wait_condition(cluster, "minilm", ns, "Available")
    assert condition(obj, "Accepted") == "True"
    pods = cluster.get_json("pods", "-n", ns, "-l", "app.kubernetes.io/instance=minilm,"
                            "app.kubernetes.io/component=runtime")["items"]
    assert pods and all(p["spec"].get("nodeName", "").startswith(("cpu-", "gpu-")) for p in pods)
    for kind in ("deployment", "service", "configmap", "poddisruptionbudget"):
        items = cluster.get_json(kind, "-n", ns, "-l", "app.kubernetes.io/instance=minilm")["items"]
        assert items, kind
        for item in items:
            refs = item["metadata"]["ownerReferences"]
            assert refs[0]["kind"] == "EmbeddingDeployment" and refs[0]["uid"] == obj["metadata"]["uid"]
    table = cluster.kubectl("get", "embeddingdeployments", "-n", ns).stdout.splitlines()
    assert table[1].split()[2] == "1"  # READY column from the real status


def test_hand_edits_and_deletions_are_reverted(standalone) -> None:
    cluster, _proc, ns = standalone
    cluster.apply(small("heal", ns, autoscaling={"enabled": False}, replicas=1))
    wait_condition(cluster, "heal", ns, "Available")
    good = _deployment(cluster, "heal", ns)["spec"]["template"]["spec"]["containers"][0]["image"]

    cluster.kubectl("set", "image", "deployment/heal", "runtime=evil/image:latest", "-n", ns)
    wait_until(lambda: _deployment(cluster, "heal", ns)["spec"]["template"]["spec"]["containers"][0]["image"]
               == good, 30, "the image reverted")

    cluster.kubectl("delete", "deployment", "heal", "-n", ns, "--wait=true")
    wait_until(lambda: _deployment(cluster, "heal", ns), 30, "the Deployment recreated")

    cluster.kubectl("delete", "service", "heal", "-n", ns, "--wait=true")
    wait_until(lambda: cluster.get_json("service", "heal", "-n", ns), 30, "the Service recreated")

    cm = cluster.get_json("configmap", "-n", ns, "-l", "app.kubernetes.io/instance=heal")["items"][0]
    key = sorted(cm["data"])[0]
    cluster.kubectl("patch", "configmap", cm["metadata"]["name"], "-n", ns, "--type=merge",
                    "-p", json.dumps({"data": {key: "tampered"}}))
    wait_until(lambda: cluster.get_json("configmap", cm["metadata"]["name"], "-n", ns)["data"][key]
               == cm["data"][key], 30, "the ConfigMap reverted")


def test_delete_removes_everything_owned(standalone) -> None:
    cluster, _proc, ns = standalone
    cluster.apply(example("gone", ns))
    wait_condition(cluster, "gone", ns, "Available")
    cluster.kubectl("delete", "embeddingdeployment", "gone", "-n", ns, "--wait=true", "--timeout=60s")

    def nothing_left() -> bool:
        for kind in ("deployments", "services", "configmaps", "poddisruptionbudgets", "daemonsets",
                     "serviceaccounts", "replicasets", "pods"):
            if cluster.get_json(kind, "-n", ns, "-l", "app.kubernetes.io/instance=gone")["items"]:
                return False
        bindings = cluster.get_json("clusterrolebindings", "-l", "app.kubernetes.io/instance=gone")["items"]
        return not bindings

    wait_until(nothing_left, 60, "every owned object garbage-collected")


def test_steady_state_writes_nothing_but_heartbeats(standalone) -> None:
    cluster, proc, ns = standalone
    cluster.apply(example("quiet", ns))
    cluster.apply(small("fixed", ns, autoscaling={"enabled": False}, replicas=2))
    wait_condition(cluster, "quiet", ns, "Available")
    wait_condition(cluster, "fixed", ns, "Available")
    # No runtime answers these pods' IPs here: the autoscaler says so once (an Event) and then keeps
    # the size without writing. (tests/operator/test_user_path.py covers steady state with real metrics.)
    time.sleep(8)
    cluster.audit_mark()
    time.sleep(20)
    assert operator_writes(proc) == []
    events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=quiet")["items"]
    assert [e["reason"] for e in events].count("SignalUnavailable") == 1  # said once, not every tick


def test_scale_subresource_resizes_with_autoscaling_on(standalone) -> None:
    cluster, _proc, ns = standalone
    cluster.apply(small("scaled", ns, autoscaling={"minReplicas": 1, "maxReplicas": 4, "intervalSeconds": 1,
                                                   "scaleDown": {"stabilizationWindowSeconds": 300}}))
    wait_condition(cluster, "scaled", ns, "Available")
    cluster.kubectl("scale", "embeddingdeployment", "scaled", "-n", ns, "--replicas=3")
    wait_until(lambda: _deployment(cluster, "scaled", ns)["spec"]["replicas"] == 3, 30, "3 replicas")
    status = wait_until(lambda: (s := cluster.get_json("ed", "scaled", "-n", ns)["status"])
                        .get("lastScaleDecision", {}).get("mode") == "manual" and s, 30, "a manual decision")
    assert status["replicas"]["desired"] == 3
    # Beyond maxReplicas is clamped, and said so.
    cluster.kubectl("scale", "embeddingdeployment", "scaled", "-n", ns, "--replicas=9")
    wait_until(lambda: _deployment(cluster, "scaled", ns)["spec"]["replicas"] == 4, 30, "clamped to 4")


#: The scale-down window of the scale-and-wait scenario: long enough that "before it ends" is a point a
#: busy machine reaches with seconds to spare, short enough to wait out twice.
WINDOW_S = 20


def _runtime_pod_ips(cluster: Cluster, name: str, ns: str) -> set[str]:
    pods = cluster.get_json("pods", "-n", ns, "-l",
                            f"app.kubernetes.io/instance={name},app.kubernetes.io/component=runtime")
    return {p["status"]["podIP"] for p in (pods or {}).get("items", [])
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
            and not p["metadata"].get("deletionTimestamp")}


def _held_until_the_window_ends(cluster: Cluster, name: str, ns: str, since: float, replicas: int) -> dict:
    """Read the Deployment again and again until WINDOW_S after `since` (a time no later than the change
    the window counts from): every read that came back before then shows `replicas`. Returns the last
    EmbeddingDeployment read in time."""
    seen, obj = 0, None
    while time.monotonic() < since + WINDOW_S - 2:
        count = _deployment(cluster, name, ns)["spec"]["replicas"]
        candidate = cluster.get_json("ed", name, "-n", ns)
        if time.monotonic() < since + WINDOW_S:  # the reads were made before the window could end
            assert count == replicas, f"{count} replicas {time.monotonic() - since:.1f}s into a {WINDOW_S}s window"
            seen, obj = seen + 1, candidate
        time.sleep(1)
    assert seen, "no read came back before the window ended"
    return obj


HOLD = re.compile(r"ScaleDownStabilizing: holding (\d+) replicas until (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


def _announced_hold(cluster: Cluster, name: str, ns: str, replicas: int, after: float) -> float:
    """The end (epoch seconds) of the scale-down hold the operator announces in lastScaleDecision for
    `replicas`, once it announces one that ends after `after` (an earlier decision's is stale)."""
    found: list[float] = []

    def announced() -> bool:
        reason = (cluster.get_json("ed", name, "-n", ns)["status"].get("lastScaleDecision") or {}).get("reason", "")
        match = HOLD.match(reason)
        if match and int(match.group(1)) == replicas:
            until = datetime.strptime(match.group(2), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
            if until > after:
                found.append(until)
        return bool(found)

    wait_until(announced, 30, f"a hold of {replicas} replicas announced in the status")
    return found[-1]


def test_scale_and_min_replicas_are_held_for_the_scale_down_window(
        kube_cluster: Cluster, pod_network: PodNetwork, unique: str, tmp_path: Path) -> None:
    """Idle pods answering /metrics (a real metrics server behind each kwok pod's IP): `kubectl scale`
    1 -> 2 stays 2 while less than scaleDown.stabilizationWindowSeconds has passed and goes back to 1
    after it; raising minReplicas to 2 scales up, and lowering it back to 1 removes the pod only after the
    window too. The status says why the count is held, and the scale-down is an Event naming the window."""
    cluster = kube_cluster
    with release(cluster, tmp_path, unique) as (_system, proc), ExitStack() as fakes:
        ns = f"hold-{unique}"
        cluster.kubectl("create", "namespace", ns)
        cluster.apply(small("held", ns, autoscaling={
            "minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 1,
            "scaleDown": {"stabilizationWindowSeconds": WINDOW_S}}))
        wait_condition(cluster, "held", ns, "Available")
        served: set[str] = set()

        def serve_every_pod() -> set[str]:
            """A metrics server saying 0 in flight behind each Running pod's IP."""
            for ip in _runtime_pod_ips(cluster, "held", ns) - served:
                url = fakes.enter_context(fake_runtime(pod_network, ip, tmp_path))
                httpx.post(f"{url}/set", json={"in_flight": 0}, timeout=5).raise_for_status()
                served.add(ip)
            return served

        wait_until(serve_every_pod, 90, "the first pod running with its metrics server")
        wait_until(lambda: (cluster.get_json("ed", "held", "-n", ns)["status"].get("lastScaleDecision")
                            or {}).get("mode") == "stable", 60, "a decision from the pods' metrics")

        # kubectl scale: applied at once, held for the window, then undone by the idle load.
        since = time.monotonic()
        cluster.kubectl("scale", "embeddingdeployment", "held", "-n", ns, "--replicas=2")
        wait_until(lambda: _deployment(cluster, "held", ns)["spec"]["replicas"] == 2, 30, "2 replicas")
        wait_until(lambda: len(serve_every_pod()) >= 2, 60, "the second pod serving metrics")
        obj = _held_until_the_window_ends(cluster, "held", ns, since, 2)
        reason = obj["status"]["lastScaleDecision"]["reason"]
        assert reason.startswith("ScaleDownStabilizing: holding 2 replicas until "), reason
        assert "2 set by hand" in reason, reason
        wait_until(lambda: _deployment(cluster, "held", ns)["spec"]["replicas"] == 1, 60,
                   "back to 1 once the window has passed")
        events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=held")["items"]
        downs = [e["message"] for e in events
                 if e["reason"] == "Scaled" and e["message"].startswith("scale down 2 -> 1")]
        assert any(f"scale-down window {WINDOW_S}s passed since 2 was last set by hand" in m for m in downs), downs

        # minReplicas up: at once; down: only after the window.
        cluster.kubectl("patch", "embeddingdeployment", "held", "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"autoscaling": {"minReplicas": 2}}}))
        wait_until(lambda: _deployment(cluster, "held", ns)["spec"]["replicas"] == 2, 30, "2 replicas")
        wait_until(lambda: len(_runtime_pod_ips(cluster, "held", ns) & serve_every_pod()) >= 2, 60,
                   "two pods serving metrics")
        time.sleep(3)  # ticks under minReplicas 2: recommendations of 2 in the window
        patched = time.time()
        cluster.kubectl("patch", "embeddingdeployment", "held", "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"autoscaling": {"minReplicas": 1}}}))
        # The window counts from the last recommendation of 2, which the autoscaling loop of a loaded machine
        # may make a few seconds before it sees the patch: its end is the operator's own, announced in the
        # status (to the second, rounded down). It lies past the patch and at most a window from now, and no
        # read shows fewer than 2 before it.
        until = _announced_hold(cluster, "held", ns, 2, after=patched)
        assert until <= time.time() + WINDOW_S, (until, patched)
        while time.time() < until:
            replicas = _deployment(cluster, "held", ns)["spec"]["replicas"]
            if time.time() < until:  # the read came back before the announced end
                assert replicas == 2, f"{replicas} replicas before the announced end of the window"
            time.sleep(1)
        wait_until(lambda: _deployment(cluster, "held", ns)["spec"]["replicas"] == 1, 60,
                   "1 replica once the window has passed")
        assert proc is not None and proc.unexpected_errors() == []


def test_gpu_rollout_completes_with_no_spare_gpu(standalone) -> None:
    """4 GPUs in the cluster (gpu-1, gpu-2 with 2 each), 2 replicas of 2 GPUs: a surge pod could never be
    scheduled, so a rollout that waits for one never finishes."""
    cluster, _proc, ns = standalone
    spec = small("gpu", ns, autoscaling={"enabled": False}, replicas=2)
    spec["spec"]["runtime"]["gpu"] = {"count": 2}
    cluster.apply(spec)
    wait_condition(cluster, "gpu", ns, "Available")
    spec["spec"]["runtime"]["maxBatchTokens"] = 8192  # a config change: new pods
    cluster.apply(spec)

    def rolled() -> bool:
        dep = _deployment(cluster, "gpu", ns)
        st = dep.get("status") or {}
        return (st.get("observedGeneration") == dep["metadata"]["generation"]
                and st.get("updatedReplicas") == 2 and st.get("readyReplicas") == 2
                and st.get("replicas") == 2)

    wait_until(rolled, 90, "the GPU rollout to finish")
    assert condition(cluster.get_json("ed", "gpu", "-n", ns), "Available") == "True"


def test_many_deployments_at_once_all_converge(standalone_chart_election) -> None:
    """Sixty at once, autoscaling on (each has an autoscaler loop): every one gets its objects and
    status. A synchronous loop per object once held every executor thread and starved the rest."""
    cluster, _proc, ns = standalone_chart_election
    docs = [small(f"m{i}", ns, autoscaling={"minReplicas": 1, "maxReplicas": 2}) for i in range(60)]
    cluster.apply(*docs)

    def converged() -> bool:
        items = cluster.get_json("ed", "-n", ns)["items"]
        return len(items) == 60 and all(condition(i, "Available") == "True" for i in items)

    wait_until(converged, 240, "60 EmbeddingDeployments Available", interval=2)


def test_invalid_spec_is_rejected_creates_nothing_then_fixed(standalone) -> None:
    cluster, proc, ns = standalone
    bad = small("broken", ns, autoscaling={"minReplicas": 5, "maxReplicas": 2})
    bad["spec"]["runtime"]["gpu"] = {"count": 1, "type": "nvidia-rtx-9090"}
    cluster.apply(bad)
    obj = wait_condition(cluster, "broken", ns, "Accepted", "False")
    (accepted,) = [c for c in obj["status"]["conditions"] if c["type"] == "Accepted"]
    assert accepted["reason"] == "InvalidSpec"
    assert "minReplicas (5) is greater than maxReplicas (2)" in accepted["message"]
    assert "nvidia-rtx-9090" in accepted["message"]
    events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=broken")["items"]
    assert any(e["reason"] == "InvalidSpec" for e in events)
    assert cluster.get_json("deployment", "broken", "-n", ns) is None
    assert not [str(e) for e in proc.writes() if e.resource in ("deployments", "services")]

    fixed = small("broken", ns, autoscaling={"minReplicas": 1, "maxReplicas": 2})
    cluster.apply(fixed)
    wait_condition(cluster, "broken", ns, "Accepted", "True")
    wait_condition(cluster, "broken", ns, "Available", "True")


def test_prepull_creates_nothing_with_node_rights_and_counts_cached_nodes(standalone) -> None:
    """Pre-pull is the node agent's job: the operator renders only the runtime pod (with its tenant's
    node-cache entry, through a claim bound to the operator's volume, and a preference for nodes labelled
    ready for that tenant) and counts cachedNodes from the Nodes' labels. Nothing is created in the tenant
    namespace with a ServiceAccount or a node right."""
    from embedfleet.operator.crd import naming

    cluster, proc, ns = standalone
    doc = example("cached", ns)
    digest = doc["spec"]["model"]["digest"]
    key = naming.cache_label_key(digest, ns)
    cluster.kubectl("label", "node", "cpu-1", f"{key}=ready")  # what the node agent writes once verified
    try:
        cluster.apply(doc)
        obj = wait_until(lambda: (o := cluster.get_json("ed", "cached", "-n", ns)) and
                         (o.get("status") or {}).get("totalNodes") and o, 90, "cache status from the Nodes")
        assert obj["status"]["cachedNodes"] == 1 and obj["status"]["totalNodes"] >= 4  # every kwok node
        dep = cluster.get_json("deployment", "cached", "-n", ns)
        pod = dep["spec"]["template"]["spec"]
        preferred = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert preferred[0]["preference"]["matchExpressions"][0]["key"] == key
        (node_cache,) = [v for v in pod["volumes"] if v["name"] == "node-cache"]
        assert node_cache["persistentVolumeClaim"]["claimName"] == naming.cache_claim(digest)
        volume = wait_until(lambda: cluster.get_json("pv", naming.cache_volume(ns, naming.cache_claim(digest))),
                            60, "the node cache's volume")
        assert volume["spec"]["hostPath"]["path"] == f"/var/lib/embedfleet/cache/{naming.cache_entry(ns, digest)}"
        for kind in ("daemonsets", "serviceaccounts", "rolebindings"):
            items = cluster.get_json(kind, "-n", ns)["items"]
            assert [i["metadata"]["name"] for i in items] == (["default"] if kind == "serviceaccounts" else [])
        assert not cluster.get_json("clusterrolebindings", "-l", "app.kubernetes.io/instance=cached")["items"]
        assert not [str(e) for e in proc.writes() if e.resource == "nodes"]  # the operator only reads Nodes
    finally:
        cluster.kubectl("label", "node", "cpu-1", f"{key}-")


def test_someone_elses_object_is_never_adopted(standalone) -> None:
    cluster, proc, ns = standalone
    cluster.kubectl("create", "deployment", "taken", "-n", ns, "--image=example.invalid/theirs:1")
    cluster.apply(small("taken", ns, autoscaling={"enabled": False}, replicas=1))
    obj = wait_condition(cluster, "taken", ns, "Degraded", "True")
    (degraded,) = [c for c in obj["status"]["conditions"] if c["type"] == "Degraded"]
    assert degraded["reason"] == "NotOwned" and "Deployment" in degraded["message"]
    theirs = cluster.get_json("deployment", "taken", "-n", ns)
    assert theirs["spec"]["template"]["spec"]["containers"][0]["image"] == "example.invalid/theirs:1"
    assert not theirs["metadata"].get("ownerReferences")
    assert not [str(e) for e in proc.writes() if (e.namespace, e.resource, e.name) == (ns, "deployments", "taken")]
