"""The real operator (`kopf run -A`) against a kmock Kubernetes emulator over HTTP.

The emulator does no defaulting, validation, garbage collection or controllers, so this test sets
``uid``/``generation``/``resourceVersion`` itself, plays the Deployment/DaemonSet controllers by patching
their status, and checks every object the operator stored against the Kubernetes client's models and
every custom resource against the generated CRD schema.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

from schema_helpers import cr_errors, k8s_model_problems

from conftest import EMBEDDING, KmockCluster, wait_for
from embedfleet.operator.crd import naming

NS = "ml"
DIGEST = "sha256:" + "c3" * 32
RUNTIME_RESOURCES = {
    "apps/v1/deployments": "Deployment",
    "v1/services": "Service",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "v1/configmaps": "ConfigMap",
}
WRITES = {"POST", "PATCH", "PUT", "DELETE"}


def embedding(name: str, spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": naming.API_VERSION,
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "generation": generation,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


BASE_SPEC: dict[str, Any] = {
    "model": {"source": "https://weights.example/minilm.tar", "digest": DIGEST},
    "runtime": {"maxBatchRequests": 32},
    "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
}


def condition(cluster: KmockCluster, name: str, type_: str) -> dict[str, Any] | None:
    obj = cluster.get(EMBEDDING, NS, name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def condition_is(cluster: KmockCluster, name: str, type_: str, value: str) -> bool:
    found = condition(cluster, name, type_)
    return found is not None and found["status"] == value


def runtime_objects(cluster: KmockCluster, name: str) -> dict[str, dict[str, Any] | None]:
    names = {"v1/configmaps": f"{name}-config"}
    return {res: cluster.get(res, NS, names.get(res, name)) for res in RUNTIME_RESOURCES}


def writes_since(cluster: KmockCluster, first_id: int, plurals: set[str]) -> list[tuple[Any, ...]]:
    return [r for r in cluster.requests() if r[0] >= first_id and r[1] in WRITES and r[2] in plurals]


def test_lifecycle_create_follow_idle_delete(kmock_cluster: KmockCluster, operator_process: Any) -> None:
    cluster = kmock_cluster
    operator_process(cluster.kubeconfig_path)
    cluster.create(EMBEDDING, NS, embedding("minilm", copy.deepcopy(BASE_SPEC)))

    objects = wait_for(
        lambda: all(runtime_objects(cluster, "minilm").values()) and runtime_objects(cluster, "minilm"),
        what="Deployment/Service/PDB/ConfigMap",
    )
    for resource, obj in objects.items():
        assert obj is not None
        assert k8s_model_problems(obj) == [], resource
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-minilm"
    deployment = objects["apps/v1/deployments"]
    assert deployment is not None and deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert pod["terminationGracePeriodSeconds"] > 30
    config = objects["v1/configmaps"]
    assert config is not None and config["data"]["EMBEDFLEET_MAX_BATCH_REQUESTS"] == "32"
    first_hash = deployment["spec"]["template"]["metadata"]["annotations"]["embedfleet.dev/config-hash"]

    wait_for(lambda: condition_is(cluster, "minilm", "Accepted", "True"), what="Accepted=True")
    cr = cluster.get(EMBEDDING, NS, "minilm")
    assert cr is not None and cr["status"]["observedGeneration"] == 1
    assert cr_errors("EmbeddingDeployment", cr) == []

    # Play the Deployment controller: one pod becomes ready; the status timer notices.
    cluster.patch(
        "apps/v1/deployments",
        NS,
        "minilm",
        {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}},
        subresource="status",
    )
    wait_for(lambda: condition_is(cluster, "minilm", "Available", "True"), what="Available=True")
    assert (cluster.get(EMBEDDING, NS, "minilm") or {})["status"]["replicas"]["ready"] == 1

    # Change the spec: the objects follow.
    cluster.patch(
        EMBEDDING,
        NS,
        "minilm",
        {
            "metadata": {"generation": 2},
            "spec": {"runtime": {"maxBatchRequests": 64}, "autoscaling": {"minReplicas": 2}},
        },
    )
    wait_for(
        lambda: (
            (cluster.get("v1/configmaps", NS, "minilm-config") or {})
            .get("data", {})
            .get("EMBEDFLEET_MAX_BATCH_REQUESTS")
            == "64"
        ),
        what="ConfigMap to follow the spec",
    )
    deployment = wait_for(
        lambda: (d := cluster.get("apps/v1/deployments", NS, "minilm")) and d["spec"]["replicas"] == 2 and d,
        what="replicas to follow minReplicas",
    )
    assert (
        deployment["spec"]["template"]["metadata"]["annotations"]["embedfleet.dev/config-hash"] != first_hash
    )
    wait_for(
        lambda: (cluster.get(EMBEDDING, NS, "minilm") or {}).get("status", {}).get("observedGeneration") == 2,
        what="observedGeneration=2",
    )

    # A restarted operator resumes the same spec: it reads everything and writes nothing.
    mark = len(cluster.requests())
    second = operator_process(cluster.kubeconfig_path)
    wait_for(
        lambda: any(r[1] == "GET" and r[2] == "poddisruptionbudgets" for r in cluster.requests()[mark:]),
        what="the resumed reconcile to read the objects",
    )
    time.sleep(2.5)  # a few status-timer ticks too
    assert (
        writes_since(cluster, mark, {"deployments", "services", "poddisruptionbudgets", "configmaps"}) == []
    )
    assert "Handler 'reconcile' succeeded" in second.log()

    # Delete: the handler removes what the emulator's missing GC would leave behind.
    cluster.delete(EMBEDDING, NS, "minilm")
    wait_for(lambda: not any(runtime_objects(cluster, "minilm").values()), what="cleanup")
    wait_for(lambda: cluster.get(EMBEDDING, NS, "minilm") is None, what="the finalizer to be released")


def test_invalid_spec_is_rejected_then_fixed(kmock_cluster: KmockCluster, operator_process: Any) -> None:
    cluster = kmock_cluster
    operator_process(cluster.kubeconfig_path)
    bad = copy.deepcopy(BASE_SPEC)
    bad["autoscaling"] = {"minReplicas": 5, "maxReplicas": 2}
    bad["runtime"]["gpu"] = {"count": 1, "type": "nvidia-rtx-9090"}
    cluster.create(EMBEDDING, NS, embedding("broken", bad))

    rejected = wait_for(
        lambda: (
            condition_is(cluster, "broken", "Accepted", "False") and condition(cluster, "broken", "Accepted")
        ),
        what="Accepted=False",
    )
    assert rejected["reason"] == "InvalidSpec"
    assert "minReplicas (5) is greater than maxReplicas (2)" in rejected["message"]
    assert "nvidia-rtx-9090" in rejected["message"]
    time.sleep(1.5)
    assert not any(runtime_objects(cluster, "broken").values())
    assert writes_since(cluster, 0, {"deployments", "services", "poddisruptionbudgets", "configmaps"}) == []
    assert cr_errors("EmbeddingDeployment", cluster.get(EMBEDDING, NS, "broken") or {}) == []

    # The operator kept running: fixing the spec brings the objects up.
    cluster.patch(
        EMBEDDING,
        NS,
        "broken",
        {
            "metadata": {"generation": 2},
            "spec": {
                "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
                "runtime": {"gpu": {"count": 0, "type": None}},
            },
        },
    )
    wait_for(lambda: all(runtime_objects(cluster, "broken").values()), what="objects after the fix")
    wait_for(lambda: condition_is(cluster, "broken", "Accepted", "True"), what="Accepted=True after the fix")


def test_prepull_daemonset_status_and_pruning(kmock_cluster: KmockCluster, operator_process: Any) -> None:
    cluster = kmock_cluster
    operator_process(cluster.kubeconfig_path)
    spec = copy.deepcopy(BASE_SPEC)
    spec["cache"] = {"prePull": True, "nodeSelector": {"pool": "cpu"}}
    cluster.create(EMBEDDING, NS, embedding("cached", spec))

    ds = wait_for(lambda: cluster.get("apps/v1/daemonsets", NS, "cached-prepull-default"), what="DaemonSet")
    assert k8s_model_problems(ds) == []
    command = ds["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert command[command.index("--digest") + 1] == DIGEST and "--label-node" in command
    binding = wait_for(
        lambda: cluster.get(
            "rbac.authorization.k8s.io/v1/clusterrolebindings", None, f"embedfleet-{NS}-cached-prepull"
        ),
        what="ClusterRoleBinding",
    )
    assert k8s_model_problems(binding) == []
    deployment = wait_for(lambda: cluster.get("apps/v1/deployments", NS, "cached"), what="Deployment")
    affinity = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    preferred = affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"][
        "matchExpressions"
    ]
    assert preferred[0]["key"] == naming.cache_label_key(DIGEST)

    # Play the DaemonSet controller: the pull finished on 1 of 2 nodes.
    cluster.patch(
        "apps/v1/daemonsets",
        NS,
        "cached-prepull-default",
        {"status": {"desiredNumberScheduled": 2, "numberReady": 1}},
        subresource="status",
    )
    wait_for(
        lambda: (cluster.get(EMBEDDING, NS, "cached") or {}).get("status", {}).get("cachedNodes") == 1,
        what="cachedNodes=1",
    )
    status = (cluster.get(EMBEDDING, NS, "cached") or {})["status"]
    assert status["totalNodes"] == 2 and condition_is(cluster, "cached", "CacheReady", "True")

    # Turning pre-pull off removes the pullers, including the cluster-scoped binding.
    cluster.patch(
        EMBEDDING, NS, "cached", {"metadata": {"generation": 2}, "spec": {"cache": {"prePull": False}}}
    )
    wait_for(
        lambda: cluster.get("apps/v1/daemonsets", NS, "cached-prepull-default") is None, what="DS pruned"
    )
    wait_for(
        lambda: (
            cluster.get(
                "rbac.authorization.k8s.io/v1/clusterrolebindings", None, f"embedfleet-{NS}-cached-prepull"
            )
            is None
        ),
        what="binding pruned",
    )
    assert cluster.get("apps/v1/deployments", NS, "cached") is not None


def test_run_operator_entry_point(kmock_cluster: KmockCluster, operator_process: Any) -> None:
    """The function `embedfleet operator run` calls starts the same operator, with a liveness probe."""
    cluster = kmock_cluster
    code = (
        "from embedfleet.operator.main import run_operator; "
        "run_operator('spoke', liveness_endpoint='{liveness}')"
    )
    operator_process(cluster.kubeconfig_path, argv=[sys.executable, "-c", code])
    cluster.create(EMBEDDING, NS, embedding("entry", copy.deepcopy(BASE_SPEC)))
    wait_for(lambda: cluster.get("apps/v1/deployments", NS, "entry"), what="Deployment via run_operator")
