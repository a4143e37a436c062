"""The node cache's claims and volumes, live: create what the rendered pods mount, let go of what they no
longer do, and delete volumes whose claim is gone. The objects themselves are render/cache_volumes.py's.

* `ensure`: for each claim an EmbeddingDeployment's pods mount, the claim (created, or this owner added to
  a claim another deployment of the namespace made) and then its volume, pre-bound to that claim's uid.
  Create-or-get: an existing volume is never changed (its path is immutable anyway); one left over from an
  older claim of the same name, which the binder would never bind to the new claim, is deleted and made anew;
* `release`: an owner's claims its pods no longer mount lose that owner (the claim goes with its last one);
* `sweep`: a volume of the operator's whose claim is gone or Released is deleted (its files stay: the node
  agent owns eviction). Run from a watch on the operator's volumes, so a claim the garbage collector removes
  takes its volume with it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from embedfleet.operator.crd import naming
from embedfleet.operator.kube import Kube, KubeError, NotOwned
from embedfleet.operator.render.cache_volumes import (
    COMPONENT,
    CacheClaim,
    claim_manifest,
    claim_owner,
    stale_volume,
    volume_manifest,
)

CLAIM = "PersistentVolumeClaim"
VOLUME = "PersistentVolume"
#: What the operator's claims and volumes carry (the watch on volumes filters by it).
SELECTOR = {naming.MANAGED_BY_LABEL: naming.MANAGED_BY, naming.COMPONENT_LABEL: COMPONENT}
#: How long `ensure` waits for a left-over volume it deleted to be gone (a Released volume has no user, so
#: its protection finalizer goes at once).
GONE_TIMEOUT = 10.0


def _ours(obj: Mapping[str, Any]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in SELECTOR.items())


def _ensure_claim(kube: Kube, claim: CacheClaim, owner: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    live = kube.get(CLAIM, claim.claim, claim.namespace)
    if live is None:
        return "created", kube.create(claim_manifest(claim, [owner]))
    meta = live.get("metadata") or {}
    if not _ours(live) or (live.get("spec") or {}).get("volumeName") != claim.volume:
        raise NotOwned(CLAIM, claim.namespace, claim.claim)
    if meta.get("deletionTimestamp"):
        raise kopf.TemporaryError(f"claim {claim.namespace}/{claim.claim} is being deleted; waiting for it to "
                                  "go (its last pod stops first)", delay=5)
    refs = list(meta.get("ownerReferences") or [])
    if any(r.get("uid") == owner["uid"] for r in refs):
        return "unchanged", live
    # resourceVersion makes this a compare-and-swap: two deployments adding themselves at once never drop one.
    patch = {"metadata": {"ownerReferences": [*refs, owner], "resourceVersion": meta.get("resourceVersion")}}
    return "patched", kube.patch_merge(CLAIM, claim.claim, claim.namespace, patch)


def _wait_gone(kube: Kube, name: str) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT
    while kube.get(VOLUME, name) is not None:
        if time.monotonic() > deadline:
            raise kopf.TemporaryError(f"PersistentVolume {name} left from an older claim is still there", delay=5)
        time.sleep(0.2)


def ensure(kube: Kube, owner_name: str, owner_uid: str, claims: Iterable[CacheClaim],
           cache_root: str) -> dict[str, str]:
    """Every claim in ``claims`` exists with this owner among its owners, and its volume exists, bound to it.
    Returns ``Kind/name`` -> created/patched for what changed (nothing in steady state: reads only)."""
    changed: dict[str, str] = {}
    owner = claim_owner(owner_name, owner_uid)
    for claim in claims:
        result, live_claim = _ensure_claim(kube, claim, owner)
        if result != "unchanged":
            changed[f"{CLAIM}/{claim.claim}"] = result
        if (live_claim.get("status") or {}).get("phase") == "Bound":
            continue  # bound to its volume (the binder checked the volume's claimRef): one read, no more
        volume = kube.get(VOLUME, claim.volume)
        if volume is not None and not _ours(volume):
            raise NotOwned(VOLUME, None, claim.volume)
        if volume is not None and stale_volume(volume, live_claim):
            kube.delete(VOLUME, claim.volume)
            _wait_gone(kube, claim.volume)
            volume = None
        if volume is None:
            uid = (live_claim.get("metadata") or {})["uid"]
            kube.create(volume_manifest(claim, cache_root, uid))
            changed[f"{VOLUME}/{claim.volume}"] = "created"
    return changed


def release(kube: Kube, namespace: str, owner_uid: str | None, keep: Iterable[CacheClaim]) -> list[str]:
    """This owner lets go of its claims in ``namespace`` not in ``keep``: a claim it alone owned is deleted
    (it stays until its last pod has stopped), one shared loses this owner. Returns ``Kind/name`` of each."""
    kept = {c.claim for c in keep}
    released = []
    for live in kube.list(CLAIM, namespace, SELECTOR):
        meta = live["metadata"]
        refs = meta.get("ownerReferences") or []
        if meta["name"] in kept or owner_uid is None or not any(r.get("uid") == owner_uid for r in refs):
            continue
        others = [r for r in refs if r.get("uid") != owner_uid]
        if others:
            patch = {"metadata": {"ownerReferences": others, "resourceVersion": meta.get("resourceVersion")}}
            kube.patch_merge(CLAIM, meta["name"], namespace, patch)
        else:
            kube.delete(CLAIM, meta["name"], namespace)
        released.append(f"{CLAIM}/{meta['name']}")
    return released


def sweep(kube: Kube, volume: Mapping[str, Any], cache_root: str) -> bool:
    """Delete one of the operator's volumes when it is left over (`stale_volume`); True when deleted. A
    volume under another root (another release's) is left to that release."""
    meta = volume.get("metadata") or {}
    spec = volume.get("spec") or {}
    path = (spec.get("hostPath") or {}).get("path") or ""
    if meta.get("deletionTimestamp") or not _ours(volume) or not path.startswith(cache_root.rstrip("/") + "/"):
        return False
    ref = spec.get("claimRef") or {}
    try:
        claim = kube.get(CLAIM, ref["name"], ref["namespace"]) if ref.get("name") and ref.get("namespace") else None
    except KubeError:
        return False  # the next event (or the operator's restart) decides
    if not stale_volume(volume, claim):
        return False
    return kube.delete(VOLUME, meta["name"])
