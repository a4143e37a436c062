"""Pod Security baseline with the node cache's entries, on a real API server: what a namespace editor can do.

Runtime pods mount their tenant's cache entries as hostPath volumes, so a namespace that pre-pulls cannot
enforce Pod Security Admission's ``baseline``; the chart's node-cache policies (templates/node-cache-policy.yaml)
enforce baseline's rules in namespaces labelled ``embedfleet.dev/pod-security=baseline``, except that a
hostPath may name the namespace's own entries. The tenant is a user bound to the built-in ``edit`` ClusterRole
in one namespace; every refusal is checked with a server-side dry run, which runs admission exactly as a real
create does. The operator's own pre-pulled deployment must still get its pods, with no refusal in its audit log.
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


def _tenant(cluster: Cluster, unique: str, labelled: bool = True) -> tuple[str, str]:
    user, ns = f"mallory-{unique}", f"team-m-{unique}"
    cluster.kubectl("create", "namespace", ns)
    if labelled:
        cluster.kubectl("label", "namespace", ns, "embedfleet.dev/pod-security=baseline")
    cluster.kubectl("create", "rolebinding", "mallory-edit", "--clusterrole=edit", f"--user={user}", "-n", ns)
    return user, ns


def _pod_with(ns: str, **changes: Any) -> dict[str, Any]:
    """A Pod with no hostPath, ``changes`` merged into its spec (key ``container`` into its container)."""
    pod = _objects(ns, "/unused")["Pod"]
    pod["spec"]["volumes"] = []
    pod["spec"]["containers"][0]["volumeMounts"] = []
    pod["spec"]["containers"][0].update(changes.pop("container", {}))
    pod["spec"].update(changes)
    return pod


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


def test_an_editor_gets_baseline_and_no_path_to_the_node_but_its_own_entries(
    kube_cluster: Cluster, unique: str, tmp_path: Path
) -> None:
    user, ns = _tenant(kube_cluster, unique)
    try:
        with release(kube_cluster, tmp_path, unique, start=False):
            _wait_active(kube_cluster, user, ns)
            other_tenant = f"{ROOT_PATH}/team-b_sha256-{'ab' * 32}"
            for path in (ROOT_PATH, ROOT_PATH + "/", other_tenant, "/", "/var", "/var/lib/",
                         "/var//lib/embedfleet/cache", "/var/lib/./embedfleet/cache",
                         "/proc/1/root/var/lib/embedfleet/cache", "/run/containerd/containerd.sock",
                         f"{ROOT_PATH}/{ns}_sha256-{'cd' * 32}/sub", f"{ROOT_PATH}/{ns}", "/tmp/scratch"):
                done = _dry_run_as(kube_cluster, user, _objects(ns, path)["Pod"])
                assert done.returncode != 0 and "own node-cache entries" in done.stderr, (path, done.stderr)
            for kind, doc in _objects(ns, other_tenant).items():
                done = _dry_run_as(kube_cluster, user, doc)
                assert done.returncode != 0 and "own node-cache entries" in done.stderr, (kind, done.stderr)
            # The rest of baseline, which a pod needs no hostPath to break.
            sc = "securityContext"
            for what, pod in {
                "hostPID": _pod_with(ns, hostPID=True), "hostNetwork": _pod_with(ns, hostNetwork=True),
                "hostIPC": _pod_with(ns, hostIPC=True),
                "privileged": _pod_with(ns, container={sc: {"privileged": True}}),
                "capabilities": _pod_with(ns, container={sc: {"capabilities": {"add": ["SYS_ADMIN"]}}}),
                "hostPort": _pod_with(ns, container={"ports": [{"containerPort": 80, "hostPort": 80}]}),
                "seccomp": _pod_with(ns, **{sc: {"seccompProfile": {"type": "Unconfined"}}}),
                "sysctl": _pod_with(ns, **{sc: {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}),
                "seLinux": _pod_with(ns, container={sc: {"seLinuxOptions": {"type": "spc_t"}}}),
            }.items():
                done = _dry_run_as(kube_cluster, user, pod)
                assert done.returncode != 0 and "baseline" in done.stderr, (what, done.stderr)
            privileged = _objects(ns, "/unused")["Deployment"]
            privileged["spec"]["template"]["spec"] = _pod_with(ns, hostPID=True)["spec"]
            done = _dry_run_as(kube_cluster, user, privileged)
            assert done.returncode != 0 and "baseline" in done.stderr, done.stderr
            # Not a blanket refusal: the namespace's own entry, and baseline's own allowances.
            own = f"{ROOT_PATH}/{ns}_sha256-{'cd' * 32}"
            for kind, doc in _objects(ns, own).items():
                done = _dry_run_as(kube_cluster, user, doc)
                assert done.returncode == 0, (kind, done.stderr)
            fine = _pod_with(ns, container={sc: {"capabilities": {"add": ["NET_BIND_SERVICE"]}}})
            assert _dry_run_as(kube_cluster, user, fine).returncode == 0
        # Outside a labelled namespace the policy leaves pods to Pod Security Admission.
        plain_user, plain = _tenant(kube_cluster, unique + "p", labelled=False)
        try:
            with release(kube_cluster, tmp_path, unique + "q", start=False):
                done = _dry_run_as(kube_cluster, plain_user, _objects(plain, "/tmp/scratch")["Pod"])
                assert done.returncode == 0, done.stderr
        finally:
            kube_cluster.kubectl("delete", "namespace", plain, "--wait=false", check=False)
    finally:
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_the_operators_pods_still_mount_their_entry_and_an_editor_cannot_redirect_it(
    kube_cluster: Cluster, unique: str, tmp_path: Path
) -> None:
    user, ns = _tenant(kube_cluster, unique)
    try:
        with release(kube_cluster, tmp_path, unique) as (_system, proc):
            _wait_active(kube_cluster, user, ns)
            kube_cluster.apply(example("cached", ns))
            pods = wait_until(lambda: (kube_cluster.get_json("pods", "-n", ns) or {}).get("items"), 90,
                              "the operator's runtime pod")
            volumes = {v["name"]: v for v in pods[0]["spec"]["volumes"]}
            assert volumes["node-cache"]["hostPath"]["path"].startswith(ROOT_PATH + "/")
            dep = kube_cluster.get_json("deployment", "cached", "-n", ns)
            dep["metadata"].pop("resourceVersion")  # the operator and the controller keep writing its status
            # The editor may not point the operator's Deployment at another tenant's entry ...
            moved = copy.deepcopy(dep)
            for v in moved["spec"]["template"]["spec"]["volumes"]:
                if v["name"] == "node-cache":
                    v["hostPath"]["path"] = f"{ROOT_PATH}/team-b_sha256-{'ab' * 32}"
            done = kube_cluster.kubectl(f"--as={user}", "replace", "--dry-run=server", "-f", "-",
                                        input=json.dumps(moved), check=False)
            assert done.returncode != 0 and "own node-cache entries" in done.stderr, done.stderr
            # ... nor make it privileged ...
            loud = copy.deepcopy(dep)
            loud["spec"]["template"]["spec"]["hostPID"] = True
            done = kube_cluster.kubectl(f"--as={user}", "replace", "--dry-run=server", "-f", "-",
                                        input=json.dumps(loud), check=False)
            assert done.returncode != 0 and "baseline" in done.stderr, done.stderr
            # ... while a change that keeps to baseline and its own entries (a label) is the editor's to make.
            kept = copy.deepcopy(dep)
            kept["metadata"].setdefault("labels", {})["team"] = "m"
            done = kube_cluster.kubectl(f"--as={user}", "replace", "--dry-run=server", "-f", "-",
                                        input=json.dumps(kept), check=False)
            assert done.returncode == 0, done.stderr
            assert proc is not None and proc.unexpected_errors() == [], proc.log()[-3000:]
    finally:
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_cache_root_with_regex_characters_compiles_and_names_only_itself(
    kube_cluster: Cluster, unique: str, tmp_path: Path
) -> None:
    """platform.cacheRoot is quoted into the policy's regular expression (the real-node tier's root holds
    dots): the API server compiles the policy, the namespace's own entry under it is admitted, and a root
    that differs only where a dot would match any character is not."""
    root = "/mnt/nvme.0/embedfleet-cache"
    user, ns = _tenant(kube_cluster, unique)
    try:
        with release(kube_cluster, tmp_path, unique, start=False, sets={"platform.cacheRoot": root}):
            pod = _objects(ns, "/mnt/nvmeX0/embedfleet-cache/" + f"{ns}_sha256-{'cd' * 32}")["Pod"]
            wait_until(lambda: "denied request" in _dry_run_as(kube_cluster, user, pod).stderr, 30,
                       "the node-cache policy to take effect")
            own = _objects(ns, f"{root}/{ns}_sha256-{'cd' * 32}")["Pod"]
            done = _dry_run_as(kube_cluster, user, own)
            assert done.returncode == 0, done.stderr
    finally:
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
