"""The node cache through PersistentVolumes, on a real API server, controller-manager and scheduler.

Pre-pulling runtime pods mount their tenant's node-cache entries through claims in their own namespace,
each pre-bound to a hostPath PersistentVolume the operator creates (render/cache_volumes.py), so a tenant
namespace enforces Pod Security Admission itself. Checked here: in a namespace with PSA ``enforce: baseline``
the ReplicaSet's pods are admitted and scheduled onto kwok nodes with their claims Bound to the operator's
volumes (path and claimRef as documented), and the same pod passes ``restricted``; a raw Pod with a hostPath
is refused by PSA; the binder never binds a claim elsewhere to a pre-bound volume, and the chart's policy
refuses such a claim at apply, a Pod that mounts a weights claim writable, and holds the operator's identity
to its own volumes; deleting the deployment
takes its claims and volumes; the operator's audit log shows no refusal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.kube.controlplane import Cluster, wait_until
from tests.operator.real import DIGEST, release, small

from embedfleet.operator.crd import naming

ROOT_PATH = "/var/lib/embedfleet/cache"  # the chart's default platform.cacheRoot
IMAGE = "ghcr.io/embedfleet/runtime:0.1.0"

pytestmark = pytest.mark.usefixtures("kube_cluster")


def _namespace(cluster: Cluster, name: str, level: str | None = "baseline") -> str:
    cluster.kubectl("create", "namespace", name)
    if level is not None:
        cluster.kubectl("label", "namespace", name, f"pod-security.kubernetes.io/enforce={level}")
    return name


def _dry_run(cluster: Cluster, doc: dict[str, Any], *, as_user: str | None = None):
    who = [f"--as={as_user}"] if as_user else []
    return cluster.kubectl(*who, "create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)


def _host_pod(ns: str, path: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "grab", "namespace": ns},
            "spec": {"containers": [{"name": "c", "image": IMAGE, "volumeMounts": [{"name": "h", "mountPath": "/h"}]}],
                     "volumes": [{"name": "h", "hostPath": {"path": path}}]}}


def _volume(name: str, path: str, ns: str, claim: str, **spec: Any) -> dict[str, Any]:
    body = {"accessModes": ["ReadOnlyMany"], "capacity": {"storage": "1Gi"}, "storageClassName": "",
            "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": path, "type": "DirectoryOrCreate"},
            "claimRef": {"namespace": ns, "name": claim}}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": body}


def _claim(ns: str, name: str, volume: str, mode: str = "ReadOnlyMany") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
            "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": volume,
                     "resources": {"requests": {"storage": "1Gi"}}}}


def _runtime_pods(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    pods = (cluster.get_json("pods", "-n", ns, "-l", f"{naming.INSTANCE_LABEL}=pre") or {}).get("items") or []
    return pods if len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods) else []


def test_a_baseline_namespace_runs_pre_pulling_pods_through_the_operators_volumes(
    kube_cluster: Cluster, unique: str, tmp_path: Path
) -> None:
    cluster = kube_cluster
    ns = _namespace(cluster, f"team-pv-{unique}")
    strict = _namespace(cluster, f"team-pvr-{unique}", "restricted")
    try:
        with release(cluster, tmp_path, unique) as (_system, proc):
            assert proc is not None
            # int8 with pre-pull: the runtime builds an engine, so its pods mount the engines folder too.
            cluster.apply(small("pre", ns, cache={"prePull": True}, autoscaling={"enabled": False}, replicas=2,
                                runtime={"image": IMAGE, "dtype": "int8",
                                         "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}))
            try:
                pods = wait_until(lambda: _runtime_pods(cluster, ns), 120,
                                  "the ReplicaSet's two pods admitted and scheduled in a baseline namespace")
            except TimeoutError as exc:
                seen = {kind: cluster.kubectl("get", kind, "-n", ns, "-o", "wide", check=False).stdout
                        for kind in ("ed", "rs", "pods", "pvc", "events")}
                seen["pv"] = cluster.kubectl("get", "pv", "-o", "wide", check=False).stdout
                raise AssertionError(f"{exc}\n{seen}\n{proc.log()[-4000:]}") from exc
            nodes = {n["metadata"]["name"] for n in cluster.get_json("nodes")["items"]}
            assert {p["spec"]["nodeName"] for p in pods} <= nodes
            weights, engines = naming.cache_claim(DIGEST), naming.engines_claim(DIGEST)
            for pod in pods:
                claims = {v["name"]: v.get("persistentVolumeClaim") for v in pod["spec"]["volumes"]}
                assert claims["node-cache"] == {"claimName": weights, "readOnly": True}
                assert claims["node-engines"] == {"claimName": engines}
                assert not [v for v in pod["spec"]["volumes"] if "hostPath" in v]
            for claim, entry, mode in ((weights, naming.cache_entry(ns, DIGEST), "ReadOnlyMany"),
                                       (engines, naming.engines_entry(ns, DIGEST), "ReadWriteMany")):
                pvc = cluster.get_json("pvc", claim, "-n", ns)
                assert pvc["status"]["phase"] == "Bound"
                assert pvc["spec"]["volumeName"] == naming.cache_volume(ns, claim) == f"embedfleet.{ns}.{claim}"
                assert [r["name"] for r in pvc["metadata"]["ownerReferences"]] == ["pre"]
                pv = cluster.get_json("pv", pvc["spec"]["volumeName"])
                assert pv["spec"]["hostPath"] == {"path": f"{ROOT_PATH}/{entry}", "type": "DirectoryOrCreate"}
                ref = pv["spec"]["claimRef"]
                assert (ref["namespace"], ref["name"], ref["uid"]) == (ns, claim, pvc["metadata"]["uid"])
                assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
                assert pv["spec"]["accessModes"] == [mode] and not pv["spec"].get("storageClassName")
                assert pv["metadata"]["labels"][naming.OWNER_NAMESPACE_LABEL] == ns

            # PSA itself refuses a raw Pod that names the cache root, or its own entry, as a hostPath.
            for path in (ROOT_PATH, f"{ROOT_PATH}/{naming.cache_entry(ns, DIGEST)}"):
                done = _dry_run(cluster, _host_pod(ns, path))
                assert done.returncode != 0 and 'violates PodSecurity "baseline' in done.stderr, done.stderr
                assert "hostPath" in done.stderr, done.stderr
            # The runtime pod passes restricted as well (non-root, no capabilities, RuntimeDefault seccomp,
            # no privilege escalation, claims and emptyDirs only).
            template = cluster.get_json("deployment", "pre", "-n", ns)["spec"]["template"]["spec"]
            copy = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runtime-copy", "namespace": strict},
                    "spec": template}
            done = _dry_run(cluster, copy)
            assert done.returncode == 0, done.stderr
            # An editor's Pod may mount the weights claim, but only read-only: the agent trusts that folder.
            for writable in ({"claimName": weights}, {"claimName": weights, "readOnly": False}):
                grab = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "grab-rw", "namespace": ns},
                        "spec": {"containers": [{"name": "c", "image": IMAGE, "securityContext": {
                            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
                                 "volumes": [{"name": "w", "persistentVolumeClaim": writable}]}}
                done = _dry_run(cluster, grab)
                assert done.returncode != 0 and "mounted read-only" in done.stderr, (writable, done.stderr)

            # Another namespace cannot have tenant A's volume: refused at apply by the chart's policy ...
            thief = _namespace(cluster, f"team-thief-{unique}")
            try:
                done = _dry_run(cluster, _claim(thief, weights, naming.cache_volume(ns, weights)))
                assert done.returncode != 0 and "node-cache volume" in done.stderr, done.stderr
                # ... and the operator's identity can write only volumes at their own claim's entry.
                name, entry = naming.cache_volume(ns, weights), f"{ROOT_PATH}/{naming.cache_entry(ns, DIGEST)}"
                bad = {
                    "/etc": _volume(name, "/etc", ns, weights),
                    "the root": _volume(name, ROOT_PATH, ns, weights),
                    "deeper": _volume(name, f"{entry}/sub", ns, weights),
                    "another tenant's entry": _volume(naming.cache_volume(thief, weights), entry, thief, weights),
                    "another spelling": _volume(name, f"{ROOT_PATH}//{naming.cache_entry(ns, DIGEST)}", ns, weights),
                    "a dot": _volume(name, f"{ROOT_PATH}/./{naming.cache_entry(ns, DIGEST)}", ns, weights),
                    "another name": _volume("grab", entry, ns, weights),
                    "another claim": _volume(f"embedfleet.{ns}.grab", entry, ns, "grab"),
                    "Recycle": _volume(name, entry, ns, weights, persistentVolumeReclaimPolicy="Recycle"),
                    "writable weights": _volume(name, entry, ns, weights, accessModes=["ReadWriteMany"]),
                    "not a hostPath": {**_volume(name, entry, ns, weights)},
                }
                local = {k: v for k, v in bad["not a hostPath"]["spec"].items() if k != "hostPath"}
                bad["not a hostPath"]["spec"] = {**local, "local": {"path": entry}, "nodeAffinity": {"required": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "x", "operator": "Exists"}]}]}}}
                for what, doc in bad.items():
                    done = _dry_run(cluster, doc, as_user=proc.user)
                    assert done.returncode != 0 and "denied request" in done.stderr, (what, done.stderr)
                good = _volume(naming.cache_volume(thief, weights), f"{ROOT_PATH}/{naming.cache_entry(thief, DIGEST)}",
                               thief, weights)
                done = _dry_run(cluster, good, as_user=proc.user)
                assert done.returncode == 0, done.stderr
                # Nor may it delete a volume that is not the node cache's.
                other = _volume(f"theirs-{unique}", "/srv/theirs", thief, "theirs")
                cluster.apply(other)
                try:
                    done = cluster.kubectl(f"--as={proc.user}", "delete", "pv", f"theirs-{unique}", "--dry-run=server",
                                           check=False)
                    assert done.returncode != 0 and "denied request" in done.stderr, done.stderr
                finally:
                    cluster.kubectl("delete", "pv", f"theirs-{unique}", "--wait=false", check=False)
            finally:
                cluster.kubectl("delete", "namespace", thief, "--wait=false", check=False)

            # Deleting the deployment takes its claims (their pods go first) and the operator its volumes.
            cluster.kubectl("delete", "embeddingdeployment", "pre", "-n", ns, "--wait=true", "--timeout=60s")
            wait_until(lambda: not (cluster.get_json("pvc", "-n", ns) or {}).get("items"), 90, "the claims gone")
            for claim in (weights, engines):
                wait_until(lambda c=claim: cluster.get_json("pv", naming.cache_volume(ns, c)) is None, 60,
                           f"the volume of {claim} deleted by the operator")
            assert proc.unexpected_errors() == [], proc.log()[-3000:]
    finally:
        for name in (ns, strict):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_the_binder_binds_a_pre_bound_volume_to_its_claim_only(kube_cluster: Cluster, unique: str) -> None:
    """What Kubernetes guarantees on its own (no policy involved: the volume is not named like the node cache's):
    a claim in another namespace, or under another name, that names a volume pre-bound to someone else's
    claim stays Pending; the claim the volume names binds."""
    cluster = kube_cluster
    owner, other = _namespace(cluster, f"pv-own-{unique}", None), _namespace(cluster, f"pv-oth-{unique}", None)
    volume = f"prebound-{unique}"
    try:
        cluster.apply(_volume(volume, f"/tmp/prebound-{unique}", owner, "mine"))
        cluster.apply(_claim(other, "mine", volume), _claim(owner, "not-mine", volume))
        cluster.apply(_claim(owner, "mine", volume))
        wait_until(lambda: (cluster.get_json("pvc", "mine", "-n", owner) or {}).get("status", {}).get("phase")
                   == "Bound", 60, "the named claim bound")
        for ns, name in ((other, "mine"), (owner, "not-mine")):
            assert cluster.get_json("pvc", name, "-n", ns)["status"]["phase"] == "Pending", (ns, name)
        pv = cluster.get_json("pv", volume)
        assert (pv["spec"]["claimRef"]["namespace"], pv["spec"]["claimRef"]["name"]) == (owner, "mine")
    finally:
        for ns in (owner, other):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", volume, "--wait=false", check=False)
