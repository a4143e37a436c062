"""The chart's RBAC judged by the API server's audit log: the operator runs as the chart's ServiceAccount,
for each role, against an installed release, and every call it makes must be allowed; what the identity
may do is compared with the exact list the code needs (tests/chart/helm.py `rights`).

The API server here also runs the OwnerReferencesPermissionEnforcement admission plugin (OpenShift and
hardened clusters do): an object whose ownerReference has blockOwnerDeletion: true may only be created by
an identity that may update the owner's finalizers.
"""

from __future__ import annotations

import base64
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helm import CHART, CI_VALUES, NO_PROMETHEUS, fullname, rights, value_args
from tests.kube.controlplane import ROOT, AuditEvent, Cluster, ControlPlane, wait_until
from tests.kube.fixtures import require_control_plane
from tests.kube.operator_proc import BENIGN, OperatorProcess, start_operator

ADMISSION = "--enable-admission-plugins=OwnerReferencesPermissionEnforcement"
#: A downloaded model (the ModelCache beside it pre-pulls the same weights), placed by the hub.
EXAMPLE = yaml.safe_load((ROOT / "examples" / "embedding-hf.yaml").read_text())
NAME = EXAMPLE["metadata"]["name"]
RUN_SECONDS = 20
HEARTBEAT_ENV = {"EMBEDFLEET_HEARTBEAT_INTERVAL": "1", "EMBEDFLEET_LEASE_DURATION": "10"}


def strict(cluster: Cluster) -> Cluster:
    """Restart the cluster's API server with OwnerReferencesPermissionEnforcement on."""
    cluster.stop_apiserver()
    cluster.apiserver_argv.append(ADMISSION)
    cluster.start_apiserver()
    return cluster


@pytest.fixture(scope="module")
def plane() -> Iterator[ControlPlane]:
    require_control_plane()
    with tempfile.TemporaryDirectory(prefix="embedfleet-chart-") as tmp:
        plane = ControlPlane.start(Path(tmp))
        try:
            yield plane
        finally:
            plane.stop()


@pytest.fixture(scope="module")
def strict_cluster(plane: ControlPlane) -> Cluster:
    """Controllers, scheduler and kwok nodes (runtime and pre-pull pods get scheduled and Ready)."""
    return strict(plane.add_cluster("strict"))


def helm_install(cluster: Cluster, release: str, namespace: str, role: str, sets: dict[str, str]) -> None:
    skip = ["--skip-crds"] if cluster.get_json("crd", "embeddingdeployments.embedfleet.dev") else []
    cluster.helm("install", release, str(CHART), "-n", namespace, "--create-namespace", "--wait=hookOnly",
                 *skip, *value_args([CI_VALUES[role]], sets))


def example(namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load(yaml.safe_dump(EXAMPLE))
    doc["metadata"]["namespace"] = namespace
    return doc


def model_cache(namespace: str) -> dict[str, Any]:
    return {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "ModelCache",
            "metadata": {"name": "weights", "namespace": namespace},
            "spec": {"model": dict(EXAMPLE["spec"]["model"])}}


def failures(events: list[AuditEvent]) -> list[str]:
    return [str(e) for e in events if e.code >= 400 and (e.code, e.verb) not in BENIGN]


def created(proc: OperatorProcess) -> set[str]:
    return {e.resource for e in proc.writes() if e.verb == "create" and e.code == 201}


def run_workload(cluster: Cluster, proc: OperatorProcess, namespace: str) -> None:
    """An EmbeddingDeployment and a ModelCache for RUN_SECONDS, then deleted while the operator runs."""
    started = time.monotonic()
    cluster.apply(example(namespace), model_cache(namespace))
    wait_until(lambda: cluster.get_json("deployment", NAME, "-n", namespace), 60,
               "the runtime Deployment (its ownerReference passes OwnerReferencesPermissionEnforcement)")
    # Pre-pull on: the cache status is counted from the Nodes (the operator's `nodes list`).
    wait_until(lambda: ((cluster.get_json("modelcache", "weights", "-n", namespace) or {}).get("status") or {})
               .get("totalNodes"), 60, "the ModelCache's totalNodes")
    time.sleep(max(0.0, RUN_SECONDS - (time.monotonic() - started)))
    for kind, name in (("embeddingdeployment", NAME), ("modelcache", "weights")):
        cluster.kubectl("delete", kind, name, "-n", namespace, "--wait=true", "--timeout=60s")
    assert proc.alive(), proc.log()[-3000:]


# The operator's rights: (resource.group, resourceName, verb), as the API server reports them.
def _crud(resource: str, verbs: str) -> set[tuple[str, str, str]]:
    return {(resource, "", v) for v in verbs.split()}


WORKLOAD_RIGHTS = (
    _crud("embeddingdeployments.embedfleet.dev", "get list watch patch")
    | _crud("modelcaches.embedfleet.dev", "get list watch patch")
    | _crud("embeddingdeployments.embedfleet.dev/status", "patch")
    | _crud("modelcaches.embedfleet.dev/status", "patch")
    | _crud("embeddingdeployments.embedfleet.dev/finalizers", "update")
    | _crud("modelcaches.embedfleet.dev/finalizers", "update")
    | {r for kind in ("configmaps", "services", "serviceaccounts", "deployments.apps", "daemonsets.apps",
                      "poddisruptionbudgets.policy", "persistentvolumeclaims")
       for r in _crud(kind, "get list watch create patch delete")}
    | _crud("servicemonitors.monitoring.coreos.com", "get list create patch delete")
    | _crud("pods", "list watch")
    | _crud("pods/eviction", "create")  # spec.spot: a spot pod on a node being reclaimed drains
    | _crud("events", "create")
    | _crud("secrets", "get")  # a tenant's apiKeySecret: its labels only (PartialObjectMetadata)
)
KOPF_RIGHTS = _crud("customresourcedefinitions.apiextensions.k8s.io", "get list watch")


#: Cache status: cachedNodes/totalNodes are counted from the node agents' labels; spec.spot watches which
#: nodes are spot and being reclaimed (read only).
NODE_READ = _crud("nodes", "list watch")
#: The node cache's volumes (cluster-scoped; the chart's policy holds them to the tenants' entries). No patch.
CACHE_VOLUMES = _crud("persistentvolumes", "get list watch create delete")
#: The node agent's identity (its own ServiceAccount in the release namespace), and nobody else's.
NODE_AGENT_RIGHTS = (_crud("nodes", "get patch") | _crud("embeddingdeployments.embedfleet.dev", "list watch")
                     | _crud("modelcaches.embedfleet.dev", "list watch"))


def lease_rights(*names: str) -> set[tuple[str, str, str]]:
    return {("leases.coordination.k8s.io", "", "create")} | {
        ("leases.coordination.k8s.io", n, v) for n in names for v in ("get", "patch")}


HUB_RIGHTS = (
    KOPF_RIGHTS
    | _crud("fleetclusters.embedfleet.dev", "list watch")  # informers: one list, then a watch
    | _crud("placementpolicies.embedfleet.dev", "list watch")
    | _crud("embeddingdeployments.embedfleet.dev", "list watch")
    | _crud("fleetclusters.embedfleet.dev/status", "patch")
    | _crud("embeddingdeployments.embedfleet.dev/status", "patch")
    | _crud("placementpolicies.embedfleet.dev/status", "patch")
    | _crud("namespaces", "list watch")
    | _crud("events", "create")
    | _crud("secrets", "get")  # the spokes' kubeconfigs, release namespace only
    | lease_rights("embedfleet-operator")
)


def test_standalone_operator_needs_exactly_the_chart_rbac(strict_cluster: Cluster, tmp_path: Path) -> None:
    cluster = strict_cluster
    release = namespace = "std"
    apps = "std-apps"
    helm_install(cluster, release, namespace, "standalone", NO_PROMETHEUS)
    cluster.kubectl("create", "namespace", apps)
    cluster.audit_mark()
    proc = start_operator(cluster, tmp_path, release=release, namespace=namespace,
                          values=[CI_VALUES["standalone"]], sets=NO_PROMETHEUS)
    try:
        run_workload(cluster, proc, apps)
    finally:
        proc.stop()
    errors = proc.unexpected_errors()
    assert errors == [], "\n".join(map(str, errors))
    assert {"configmaps", "deployments", "services", "events", "leases"} <= created(proc)
    # Pre-pull creates nothing with a node right in the tenant's namespace, and nothing cluster-scoped.
    assert not {"daemonsets", "serviceaccounts", "clusterrolebindings"} & created(proc)
    # ... but the claim its pods mount the weights through, and the volume behind it.
    assert {"persistentvolumeclaims", "persistentvolumes"} <= created(proc)
    assert cluster.get_json("serviceaccounts", "-n", apps)["items"][0]["metadata"]["name"] == "default"
    assert rights(cluster, f"system:serviceaccount:{apps}:default", apps) == set()

    user = proc.user
    assert rights(cluster, user, namespace) == (WORKLOAD_RIGHTS | KOPF_RIGHTS | NODE_READ | CACHE_VOLUMES
                                                | lease_rights("std-embedfleet-operator"))
    agent = f"system:serviceaccount:{namespace}:{fullname(release)}-node-agent"
    assert rights(cluster, agent, namespace) == NODE_AGENT_RIGHTS
    assert rights(cluster, agent, apps) == NODE_AGENT_RIGHTS


def test_spoke_operator_needs_exactly_the_chart_rbac(strict_cluster: Cluster, tmp_path: Path) -> None:
    """The spoke's ci values watch two namespaces that do not exist: the install creates them, the
    operator is bound only there, and its heartbeat can read the nodes' cache labels."""
    cluster = strict_cluster
    release = namespace = "spk"
    watched = ["spk-embeddings", "spk-search"]
    sets = {**NO_PROMETHEUS, **{f"watchNamespaces[{i}]": ns for i, ns in enumerate(watched)}}
    helm_install(cluster, release, namespace, "spoke", sets)
    cluster.audit_mark()
    proc = start_operator(cluster, tmp_path, release=release, namespace=namespace, values=[CI_VALUES["spoke"]],
                          sets=sets, env=HEARTBEAT_ENV)
    try:
        run_workload(cluster, proc, watched[0])
        lease = cluster.get_json("lease", "embedfleet-spoke", "-n", namespace)
    finally:
        proc.stop()
    errors = proc.unexpected_errors()
    assert errors == [], "\n".join(map(str, errors))
    assert "embedfleet.dev/heartbeat-problem" not in (lease["metadata"].get("annotations") or {})
    assert {"configmaps", "deployments", "leases"} <= created(proc)
    assert not {"daemonsets", "clusterrolebindings"} & created(proc)

    user = proc.user
    cluster_wide = KOPF_RIGHTS | _crud("namespaces", "list watch") | NODE_READ | CACHE_VOLUMES
    leases = lease_rights("spk-embedfleet-operator", "embedfleet-spoke")
    gateway_pods = _crud("pods", "list")  # the heartbeat's gateway load, in the release namespace
    assert rights(cluster, user, namespace) == cluster_wide | leases | gateway_pods
    assert rights(cluster, user, watched[1]) == cluster_wide | WORKLOAD_RIGHTS
    assert rights(cluster, user, "default") == cluster_wide  # not watched: nothing namespaced


def test_hub_places_on_a_spoke_through_the_charts_hub_access(plane: ControlPlane, tmp_path: Path) -> None:
    """A hub and a spoke, each with its ci/ values. The hub's kubeconfig for the spoke authenticates as
    the ServiceAccount the spoke's chart made for it (hubAccess); the hub places the example there, and
    deletes the copy when the hub object goes. No identity is refused anything on either cluster."""
    hub = strict(plane.add_cluster("hub", nodes=None, controllers=False))
    spoke = strict(plane.add_cluster("spoke", nodes=None, controllers=False))
    system = "embedfleet-system"
    helm_install(spoke, "embedfleet", system, "spoke", NO_PROMETHEUS)
    helm_install(hub, "embedfleet", system, "hub", {})
    hub_identity = f"system:serviceaccount:{system}:embedfleet-hub"
    hub_on_spoke = (_crud("embeddingdeployments.embedfleet.dev", "get list watch create patch delete")
                    | _crud("namespaces", "get create"))  # no Secret: hubAccess.propagateSecrets is off
    assert rights(spoke, hub_identity, system) == hub_on_spoke | {
        ("leases.coordination.k8s.io", "embedfleet-spoke", verb) for verb in ("get", "list", "watch")}
    assert rights(spoke, hub_identity, "embeddings") == hub_on_spoke
    hub.audit_mark()
    spoke.audit_mark()

    spoke_proc = start_operator(spoke, tmp_path, release="embedfleet", namespace=system,
                                values=[CI_VALUES["spoke"]], sets=NO_PROMETHEUS, env=HEARTBEAT_ENV, name="spoke")
    hub_proc = start_operator(hub, tmp_path, release="embedfleet", namespace=system, values=[CI_VALUES["hub"]],
                              env={"EMBEDFLEET_HUB_INTERVAL": "1", "EMBEDFLEET_HUB_RAMP_SECONDS": "1"}, name="hub")
    try:
        token = spoke.token_for(system, "embedfleet-hub")
        kubeconfig = spoke.kubeconfig_for(token, tmp_path / "hub-on-spoke.kubeconfig", namespace=system,
                                          user="embedfleet-hub")
        hub.apply(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "eu-a-kubeconfig", "namespace": system},
             "data": {"kubeconfig": base64.b64encode(kubeconfig.read_bytes()).decode()}},
            {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "FleetCluster", "metadata": {"name": "eu-a"},
             "spec": {"provider": "aws", "region": "eu-west-1", "capacity": {"cpuReplicas": 20},
                      "connection": {"kubeconfigSecret": {"name": "eu-a-kubeconfig", "namespace": system},
                                     "namespace": system},
                      "lease": {"durationSeconds": 10, "graceSeconds": 10}}},
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "embeddings"}},
        )
        hub.apply(example("embeddings"))
        copy = wait_until(lambda: spoke.get_json("embeddingdeployment", NAME, "-n", "embeddings"), 90,
                          f"the hub's copy on the spoke\n{hub_proc.log()[-3000:]}")
        assert copy["metadata"]["labels"].get("embedfleet.dev/hub-managed") == "eu-a"
        wait_until(lambda: spoke.get_json("deployment", NAME, "-n", "embeddings"), 60,
                   "the spoke operator running the copy")
        hub.kubectl("delete", "embeddingdeployment", NAME, "-n", "embeddings")
        wait_until(lambda: spoke.get_json("embeddingdeployment", NAME, "-n", "embeddings") is None, 90,
                   "the copy removed once the hub object is gone")
        assert hub_proc.alive() and spoke_proc.alive()
    finally:
        hub_proc.stop()
        spoke_proc.stop()
    for proc in (hub_proc, spoke_proc):
        errors = proc.unexpected_errors()
        assert errors == [], "\n".join(map(str, errors))
    hub_calls = [e for e in spoke.audit() if e.user == hub_identity]
    assert failures(hub_calls) == []
    made = {(e.verb, e.resource) for e in hub_calls if e.code < 300}
    assert made >= {("create", "embeddingdeployments"), ("delete", "embeddingdeployments")}, made
    # the heartbeat: read by name (a get, or the watch-driven loop's list and watch by field selector)
    assert made & {("get", "leases"), ("watch", "leases")}, made
    assert {e.name for e in hub_calls if e.resource == "leases"} == {"embedfleet-spoke"}
    assert rights(hub, hub_proc.user, system) == HUB_RIGHTS
    assert rights(hub, hub_proc.user, "embeddings") == HUB_RIGHTS - _crud("secrets", "get") - {
        r for r in HUB_RIGHTS if r[0] == "leases.coordination.k8s.io"}
    fleet_cluster = hub.get_json("fleetcluster", "eu-a")
    joined = [c for c in fleet_cluster["status"]["conditions"] if c["type"] == "Joined"]
    assert joined and joined[0]["status"] == "True"
