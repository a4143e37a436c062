"""handlers/cache_volumes.py against an in-memory API: claims shared by two deployments of a namespace,
released by one and then the other, a volume left from an older claim of the same name made anew, and the
sweep. (tests/operator/test_cache_volumes_real.py runs the single-owner path on a real API server.)"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from embedfleet.operator.crd import naming
from embedfleet.operator.handlers import cache_volumes
from embedfleet.operator.render.cache_volumes import CacheClaim

DIGEST = "sha256:" + "5e" * 32
ROOT = "/var/lib/embedfleet/cache"
CLAIM = CacheClaim("team-a", naming.cache_claim(DIGEST))


class FakeKube:
    """Objects by (kind, namespace, name); uids and resourceVersions as a server gives them."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.ids = itertools.count(1)
        self.writes: list[str] = []

    def _key(self, kind: str, name: str, namespace: str | None) -> tuple[str, str | None, str]:
        return kind, namespace if kind != "PersistentVolume" else None, name

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        found = self.objects.get(self._key(kind, name, namespace))
        return copy.deepcopy(found) if found else None

    def list(self, kind: str, namespace: str | None = None, selector: dict[str, str] | None = None) -> list[Any]:
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items()
                if k == kind and ns == namespace
                and all(o["metadata"].get("labels", {}).get(a) == b for a, b in (selector or {}).items())]

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(manifest)
        obj["metadata"].update(uid=f"uid-{next(self.ids)}", resourceVersion="1")
        self.objects[self._key(obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace"))] = obj
        self.writes.append(f"create {obj['kind']}/{obj['metadata']['name']}")
        return copy.deepcopy(obj)

    def patch_merge(self, kind: str, name: str, namespace: str | None, patch: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[self._key(kind, name, namespace)]
        assert patch["metadata"].pop("resourceVersion") == obj["metadata"]["resourceVersion"]  # compare-and-swap
        obj["metadata"].update(patch["metadata"])
        obj["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        self.writes.append(f"patch {kind}/{name}")
        return copy.deepcopy(obj)

    def delete(self, kind: str, name: str, namespace: str | None = None) -> bool:
        self.writes.append(f"delete {kind}/{name}")
        return self.objects.pop(self._key(kind, name, namespace), None) is not None


def _owners(kube: FakeKube) -> list[str]:
    return [r["name"] for r in kube.get("PersistentVolumeClaim", CLAIM.claim, "team-a")["metadata"]["ownerReferences"]]


def test_two_deployments_share_a_claim_and_it_goes_with_the_last() -> None:
    kube = FakeKube()
    assert cache_volumes.ensure(kube, "a", "uid-a", [CLAIM], ROOT) == {
        f"PersistentVolumeClaim/{CLAIM.claim}": "created", f"PersistentVolume/{CLAIM.volume}": "created"}
    volume = kube.get("PersistentVolume", CLAIM.volume)
    claim_uid = kube.get("PersistentVolumeClaim", CLAIM.claim, "team-a")["metadata"]["uid"]
    assert volume["spec"]["claimRef"]["uid"] == claim_uid
    assert volume["spec"]["hostPath"]["path"] == f"{ROOT}/{naming.cache_entry('team-a', DIGEST)}"
    patched = cache_volumes.ensure(kube, "b", "uid-b", [CLAIM], ROOT)
    assert patched == {f"PersistentVolumeClaim/{CLAIM.claim}": "patched"}
    assert _owners(kube) == ["a", "b"]
    kube.writes.clear()
    assert cache_volumes.ensure(kube, "a", "uid-a", [CLAIM], ROOT) == {} and kube.writes == []  # steady: reads only
    assert cache_volumes.release(kube, "team-a", "uid-a", keep=[]) == [f"PersistentVolumeClaim/{CLAIM.claim}"]
    assert _owners(kube) == ["b"]
    assert cache_volumes.release(kube, "team-a", "uid-a", keep=[]) == []  # no longer an owner
    assert cache_volumes.release(kube, "team-a", "uid-b", keep=[CLAIM]) == []  # still wanted
    assert cache_volumes.release(kube, "team-a", "uid-b", keep=[]) == [f"PersistentVolumeClaim/{CLAIM.claim}"]
    assert kube.get("PersistentVolumeClaim", CLAIM.claim, "team-a") is None
    # The volume's claim is gone: the sweep deletes it (a volume under another root is another release's).
    volume = kube.get("PersistentVolume", CLAIM.volume)
    assert not cache_volumes.sweep(kube, volume, "/elsewhere")
    assert cache_volumes.sweep(kube, volume, ROOT)
    assert kube.get("PersistentVolume", CLAIM.volume) is None


def test_a_volume_of_an_older_claim_of_the_same_name_is_made_anew() -> None:
    kube = FakeKube()
    cache_volumes.ensure(kube, "a", "uid-a", [CLAIM], ROOT)
    kube.delete("PersistentVolumeClaim", CLAIM.claim, "team-a")  # the garbage collector, say
    assert cache_volumes.ensure(kube, "a2", "uid-a2", [CLAIM], ROOT) == {
        f"PersistentVolumeClaim/{CLAIM.claim}": "created", f"PersistentVolume/{CLAIM.volume}": "created"}
    claim_uid = kube.get("PersistentVolumeClaim", CLAIM.claim, "team-a")["metadata"]["uid"]
    assert kube.get("PersistentVolume", CLAIM.volume)["spec"]["claimRef"]["uid"] == claim_uid
    live = kube.get("PersistentVolume", CLAIM.volume)
    assert not cache_volumes.sweep(kube, {**live, "status": {"phase": "Bound"}}, ROOT)


def test_someone_elses_claim_of_that_name_is_not_adopted() -> None:
    kube = FakeKube()
    kube.create({"kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM.claim, "namespace": "team-a"},
                 "spec": {"volumeName": "theirs"}})
    try:
        cache_volumes.ensure(kube, "a", "uid-a", [CLAIM], ROOT)
    except cache_volumes.NotOwned as exc:
        assert "PersistentVolumeClaim team-a/" in str(exc)
    else:
        raise AssertionError("adopted someone else's claim")
    assert kube.get("PersistentVolume", CLAIM.volume) is None
