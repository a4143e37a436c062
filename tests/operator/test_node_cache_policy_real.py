"""The node cache's guard on a real API server: a namespace editor cannot mount the cache root.

Runtime pods mount their tenant's cache entries as hostPath volumes, so tenant namespaces cannot run under
Pod Security ``baseline``; the chart's node-cache policies (templates/node-cache-policy.yaml) refuse every
hostPath that reaches the cache root unless it comes down the operator's chain (its Deployment, the
Deployment controller's ReplicaSet, the ReplicaSet controller's Pod). The tenant here is a user bound to the
built-in ``edit`` ClusterRole in one namespace; every refusal is checked with a server-side dry run, which
runs admission exactly as a real create does. The operator's own pre-pulled deployment must still get its
pods, and the operator's audit log must show no refusal.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from tests.kube.controlplane import Cluster, wait_until
from tests.operator.real import example, release

ROOT_PATH = "/var/lib/embedfleet/cache"  # the chart's default platform.cacheRoot

pytestmark = pytest.mark.usefixtures("kube_cluster")


def _pod_spec(path: str) -> dict[str, Any]:
    return {"containers": [{"name": "c", "image": "ghcr.io/embedfleet/runtime:0.1.0",
                            "volumeMounts": [{"name": "h", "mountPath": "/h"}]}],
            "volumes": [{"name": "h", "hostPath": {"path": path}}]}


def _template(path: str) -> dict[str, Any]:
    return {"metadata": {"labels": {"app": "x"}}, "spec": _pod_spec(path)}


def _objects(ns: str, path: str) -> dict[str, dict[str, Any]]:
    """One object of every kind that runs a pod, each mounting ``path``."""
    meta = {"name": "grab", "namespace": ns}
    selector = {"matchLabels": {"app": "x"}}
    job_template = _template(path)
    job_template["spec"]["restartPolicy"] = "Never"
    return {
        "Pod": {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": _pod_spec(path)},
        "Deployment": {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                       "spec": {"selector": selector, "template": _template(path)}},
        "ReplicaSet": {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": meta,
                       "spec": {"selector": selector, "template": _template(path)}},
        "StatefulSet": {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta,
                        "spec": {"selector": selector, "serviceName": "grab", "template": _template(path)}},
        "DaemonSet": {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta,
                      "spec": {"selector": selector, "template": _template(path)}},
        "Job": {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {"template": job_template}},
        "CronJob": {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": meta,
                    "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": job_template}}}},
        "ReplicationController": {"apiVersion": "v1", "kind": "ReplicationController", "metadata": meta,
                                  "spec": {"selector": {"app": "x"}, "template": _template(path)}},
    }


def _dry_run_as(cluster: Cluster, user: str, doc: dict[str, Any]):
    return cluster.kubectl(f"--as={user}", "create", "--dry-run=server", "-f", "-", input=json.dumps(doc),
                           check=False)


def _tenant(cluster: Cluster, unique: str) -> tuple[str, str]:
    user, ns = f"mallory-{unique}", f"team-m-{unique}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("create", "rolebinding", "mallory-edit", "--clusterrole=edit", f"--user={user}", "-n", ns)
    return user, ns


def _wait_active(cluster: Cluster, user: str, ns: str) -> None:
    """A new policy takes effect once the API server has compiled it: wait for the first refusal, then check
    its CEL type-checked with no warning."""
    pod = _objects(ns, ROOT_PATH)["Pod"]
    wait_until(lambda: "denied request" in _dry_run_as(cluster, user, pod).stderr, 30,
               "the node-cache policy to take effect")
    for vap in (cluster.get_json("validatingadmissionpolicies") or {}).get("items", []):
        if "node-cache" in vap["metadata"]["name"]:
            checking = (vap.get("status") or {}).get("typeChecking") or {}
            assert not checking.get("expressionWarnings"), (vap["metadata"]["name"], checking)


def test_an_editor_cannot_mount_the_cache_root_by_any_kind_or_spelling(
    kube_cluster: Cluster, unique: str, tmp_path: Path
) -> None:
    user, ns = _tenant(kube_cluster, unique)
    try:
        with release(kube_cluster, tmp_path, unique, start=False):
            _wait_active(kube_cluster, user, ns)
            other_tenant = f"{ROOT_PATH}/team-b_sha256-{'ab' * 32}"
            for path in (ROOT_PATH, ROOT_PATH + "/", other_tenant, "/", "/var", "/var/lib/",
                         "/var//lib/embedfleet/cache", "/var/lib/./embedfleet/cache"):
                done = _dry_run_as(kube_cluster, user, _objects(ns, path)["Pod"])
                assert done.returncode != 0 and "reaches the node cache" in done.stderr, (path, done.stderr)
            for kind, doc in _objects(ns, other_tenant).items():
                done = _dry_run_as(kube_cluster, user, doc)
                assert done.returncode != 0 and "reaches the node cache" in done.stderr, (kind, done.stderr)
            # Not a blanket refusal: the editor's other hostPaths are Pod Security's business, not ours,
            # and a sibling of the root is no part of it.
            for path in ("/tmp/scratch", "/var/lib/embedfleet/cache-other"):
                for kind, doc in _objects(ns, path).items():
                    done = _dry_run_as(kube_cluster, user, doc)
                    assert done.returncode == 0, (kind, path, done.stderr)
    finally:
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_the_operators_chain_still_mounts_its_entry_and_an_editor_cannot_redirect_it(
    kube_cluster: Cluster, unique: str, tmp_path: Path
) -> None:
    user, ns = _tenant(kube_cluster, unique)
    try:
        with release(kube_cluster, tmp_path, unique) as (_system, proc):
            _wait_active(kube_cluster, user, ns)
            kube_cluster.apply(example("cached", ns))
            pods = wait_until(lambda: (kube_cluster.get_json("pods", "-n", ns) or {}).get("items"), 90,
                              "the operator's runtime pod, created down the chain")
            volumes = {v["name"]: v for v in pods[0]["spec"]["volumes"]}
            assert volumes["node-cache"]["hostPath"]["path"].startswith(ROOT_PATH + "/")
            dep = kube_cluster.get_json("deployment", "cached", "-n", ns)
            # The editor may not point the operator's Deployment at another tenant's entry ...
            moved = copy.deepcopy(dep)
            for v in moved["spec"]["template"]["spec"]["volumes"]:
                if v["name"] == "node-cache":
                    v["hostPath"]["path"] = f"{ROOT_PATH}/team-b_sha256-{'ab' * 32}"
            done = kube_cluster.kubectl(f"--as={user}", "replace", "--dry-run=server", "-f", "-",
                                        input=json.dumps(moved), check=False)
            assert done.returncode != 0 and "reaches the node cache" in done.stderr, done.stderr
            # ... while a change that keeps its paths (a label) is the editor's to make.
            kept = copy.deepcopy(dep)
            kept["metadata"].setdefault("labels", {})["team"] = "m"
            done = kube_cluster.kubectl(f"--as={user}", "replace", "--dry-run=server", "-f", "-",
                                        input=json.dumps(kept), check=False)
            assert done.returncode == 0, done.stderr
            assert proc is not None and proc.unexpected_errors() == [], proc.log()[-3000:]
    finally:
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
