"""The node cache as claims and PersistentVolumes: how a runtime pod reaches its tenant's node-cache entries
without naming a host path itself. Pure: no I/O.

A pre-pulling runtime pod mounts claims in its own namespace (render/model.py): ``embedfleet-sha256-<hex>``
(the weights, read-only) and, for a runtime that builds an engine, ``embedfleet-engines-sha256-<hex>``
(writable). Each claim is bound to one cluster-scoped PersistentVolume the operator creates, named
``embedfleet.<namespace>.<claim>``, of type hostPath (``DirectoryOrCreate``) at exactly that tenant's entry
``<cacheRoot>/<namespace>_<claim without "embedfleet-">``, with ``claimRef`` naming that one claim (and its
uid): the API server's binder binds no other claim to it. So a tenant namespace can enforce Pod Security
Admission (hostPath is forbidden in its pods; a claim is not), and only the operator's identity, bounded by
the chart's policy (templates/cache-volume-policy.yaml), ever names a host path.

A claim is shared by every EmbeddingDeployment of the namespace that wants the same entry: each adds its own
(non-controller) owner reference, so the garbage collector removes the claim with the last of them. Its
volume is ``Retain``: deleting it (once Released: its claim is gone) leaves the files to the node agent, which
owns cache eviction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from embedfleet.operator.crd import naming

#: The pod volumes (render/model.py) that name a cache claim.
CLAIM_VOLUMES = ("node-cache", "node-engines")
#: storageClassName of the claims and volumes: the empty class, which no provisioner serves, so a claim binds
#: only to the volume it names.
STORAGE_CLASS = ""
#: A nominal size: hostPath has no capacity of its own (the node agent bounds what it keeps).
CAPACITY = "1Gi"
COMPONENT = "node-cache"
#: On the volume: the whole digest (a label value holds 63 characters).
DIGEST_ANNOTATION = "embedfleet.dev/digest"
DIGEST_LABEL = "embedfleet.dev/digest"


@dataclass(frozen=True, order=True)
class CacheClaim:
    """One tenant's cache entry as a claim in its namespace and the volume bound to it."""

    namespace: str
    claim: str

    @property
    def engines(self) -> bool:
        """True for an engines folder (writable by the runtime), False for weights (read-only)."""
        return self.claim.startswith(naming.CACHE_CLAIM_PREFIX + "engines-")

    @property
    def digest(self) -> str:
        return "sha256:" + self.claim.rsplit("sha256-", 1)[1]

    @property
    def volume(self) -> str:
        return naming.cache_volume(self.namespace, self.claim)

    def path(self, cache_root: str) -> str:
        return cache_root.rstrip("/") + "/" + naming.claim_entry(self.namespace, self.claim)

    @property
    def access_modes(self) -> list[str]:
        return ["ReadWriteMany"] if self.engines else ["ReadOnlyMany"]


def wanted_claims(namespace: str, manifests: Iterable[Mapping[str, Any]]) -> list[CacheClaim]:
    """The cache claims the rendered Deployments' pods mount, each once, sorted: what must exist (and be
    bound) for those pods to start. Derived from the pods, so the two cannot disagree."""
    found: set[CacheClaim] = set()
    for manifest in manifests:
        if manifest.get("kind") != "Deployment":
            continue
        for volume in manifest["spec"]["template"]["spec"].get("volumes") or []:
            source = volume.get("persistentVolumeClaim")
            if volume.get("name") in CLAIM_VOLUMES and source:
                found.add(CacheClaim(namespace, source["claimName"]))
    return sorted(found)


def labels(claim: CacheClaim) -> dict[str, str]:
    """What marks a claim or volume as the operator's, and names its tenant and weights."""
    return {
        naming.MANAGED_BY_LABEL: naming.MANAGED_BY,
        naming.COMPONENT_LABEL: COMPONENT,
        naming.OWNER_NAMESPACE_LABEL: claim.namespace,
        DIGEST_LABEL: naming.digest_hex(claim.digest)[:16],
    }


def claim_owner(name: str, uid: str) -> dict[str, Any]:
    """An EmbeddingDeployment as one of a claim's owners: not its controller (several may share it)."""
    return {"apiVersion": naming.API_VERSION, "kind": naming.EMBEDDING_DEPLOYMENT_KIND, "name": name, "uid": uid,
            "controller": False, "blockOwnerDeletion": True}


def claim_manifest(claim: CacheClaim, owners: list[dict[str, Any]]) -> dict[str, Any]:
    """The claim in the tenant's namespace, naming its volume (`volume_manifest`)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": claim.claim, "namespace": claim.namespace, "labels": labels(claim),
                     "annotations": {DIGEST_ANNOTATION: claim.digest}, "ownerReferences": owners},
        "spec": {
            "accessModes": claim.access_modes,
            "storageClassName": STORAGE_CLASS,
            "volumeName": claim.volume,
            "resources": {"requests": {"storage": CAPACITY}},
        },
    }


def volume_manifest(claim: CacheClaim, cache_root: str, claim_uid: str) -> dict[str, Any]:
    """The cluster-scoped volume at the tenant's entry, pre-bound to exactly that claim (by name and uid)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": claim.volume, "labels": labels(claim), "annotations": {DIGEST_ANNOTATION: claim.digest}},
        "spec": {
            "accessModes": claim.access_modes,
            "capacity": {"storage": CAPACITY},
            "storageClassName": STORAGE_CLASS,
            "persistentVolumeReclaimPolicy": "Retain",
            "volumeMode": "Filesystem",
            "hostPath": {"path": claim.path(cache_root), "type": "DirectoryOrCreate"},
            "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": claim.namespace,
                         "name": claim.claim, "uid": claim_uid},
        },
    }


def stale_volume(volume: Mapping[str, Any], claim: Mapping[str, Any] | None) -> bool:
    """Whether one of the operator's volumes is left over: its claim is gone (or is a newer claim of the same
    name, which the binder will never bind to it), or the binder has Released it."""
    if (volume.get("status") or {}).get("phase") == "Released":
        return True
    ref = (volume.get("spec") or {}).get("claimRef") or {}
    if claim is None:
        return True
    return bool(ref.get("uid")) and ref.get("uid") != (claim.get("metadata") or {}).get("uid")
