"""All Kubernetes I/O of the operator's reconcile path, through the official ``kubernetes`` client.

One generic path for every kind (a small table maps kind -> URL) instead of one typed API per kind, so
apply/diff/prune behave identically for ConfigMaps and DaemonSets alike.

Apply converges from what is live, not from what we last wrote: an object is left alone only when the
live object already *covers* the manifest (every field we set has our value; fields the server defaults
or other controllers own are ignored; quantities compare by value, so ``1000m`` equals ``1``) **and** our
``embedfleet.dev/last-applied`` annotation equals the manifest (so a field we stopped setting is removed).
Anything else, a hand edit of the image included, is patched back. A reconcile of an unchanged spec on
an untouched cluster therefore issues no writes. On change, the whole manifest is sent as a JSON merge
patch, with explicit nulls for fields the previous manifest had and the new one drops.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import kubernetes
from kubernetes.utils import parse_quantity

from embedfleet.kit.client import TIMEOUT, KubeClient, KubeError
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import (
    FLEET_CLUSTER_KIND,
    FLEET_CLUSTER_PLURAL,
    PLACEMENT_POLICY_KIND,
    PLACEMENT_POLICY_PLURAL,
)

log = logging.getLogger(__name__)

LAST_APPLIED = "embedfleet.dev/last-applied"
MERGE_PATCH = "application/merge-patch+json"
DISCOVERY_TTL = 300.0

ApplyResult = Literal["created", "patched", "unchanged"]
_READ: Any = object()  # apply(): "read the live object yourself"


@dataclass(frozen=True)
class Kind:
    api_version: str
    plural: str
    namespaced: bool

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        if self.namespaced:
            if namespace is None:
                raise ValueError(f"{self.plural} is namespaced: a namespace is required")
            base += f"/namespaces/{urllib.parse.quote(namespace)}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{urllib.parse.quote(name)}"
        if subresource is not None:
            base += f"/{subresource}"
        return base


KINDS: dict[str, Kind] = {
    "ConfigMap": Kind("v1", "configmaps", True),
    "Service": Kind("v1", "services", True),
    "ServiceAccount": Kind("v1", "serviceaccounts", True),
    "Event": Kind("v1", "events", True),
    "Secret": Kind("v1", "secrets", True),
    "Pod": Kind("v1", "pods", True),
    "PersistentVolumeClaim": Kind("v1", "persistentvolumeclaims", True),
    "PersistentVolume": Kind("v1", "persistentvolumes", False),
    "Node": Kind("v1", "nodes", False),
    "Namespace": Kind("v1", "namespaces", False),
    "Lease": Kind("coordination.k8s.io/v1", "leases", True),
    "Deployment": Kind("apps/v1", "deployments", True),
    "DaemonSet": Kind("apps/v1", "daemonsets", True),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets", True),
    "ClusterRoleBinding": Kind("rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "ServiceMonitor": Kind("monitoring.coreos.com/v1", "servicemonitors", True),
    naming.EMBEDDING_DEPLOYMENT_KIND: Kind(naming.API_VERSION, naming.EMBEDDING_DEPLOYMENT_PLURAL, True),
    naming.MODEL_CACHE_KIND: Kind(naming.API_VERSION, naming.MODEL_CACHE_PLURAL, True),
    FLEET_CLUSTER_KIND: Kind(naming.API_VERSION, FLEET_CLUSTER_PLURAL, False),
    PLACEMENT_POLICY_KIND: Kind(naming.API_VERSION, PLACEMENT_POLICY_PLURAL, False),
}

#: Kinds an EmbeddingDeployment or ModelCache may own, in deletion order (consumers first).
OWNED_KINDS = (
    "ServiceMonitor",
    "PodDisruptionBudget",
    "Service",
    "Deployment",
    "DaemonSet",
    "ClusterRoleBinding",
    "ServiceAccount",
    "ConfigMap",
)


class NotOwned(Exception):
    """A live object has the name we would write but belongs to someone else: we leave it alone."""

    def __init__(self, kind: str, namespace: str | None, name: str) -> None:
        where = f"{namespace}/{name}" if namespace else name
        super().__init__(f"{kind} {where} exists and is not owned by this resource; rename it, delete it, or "
                         "choose another EmbeddingDeployment name (it is left untouched)")
        self.kind, self.namespace, self.name = kind, namespace, name


def owned_by_us(live: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
    """Whether ``live`` is ours to change: the same controller owner (uid) when the manifest names one,
    else our managed-by and instance labels (cluster-scoped objects, which cannot have a namespaced owner)."""
    want_refs = (manifest.get("metadata") or {}).get("ownerReferences") or []
    live_meta = live.get("metadata") or {}
    if want_refs:
        uids = {r.get("uid") for r in live_meta.get("ownerReferences") or []}
        return any(r.get("uid") in uids for r in want_refs)
    want_labels = (manifest.get("metadata") or {}).get("labels") or {}
    have = live_meta.get("labels") or {}
    keys = (naming.MANAGED_BY_LABEL, naming.INSTANCE_LABEL)
    return all(have.get(k) == want_labels.get(k) for k in keys if k in want_labels)


def merge_patch_deletions(old: Any, new: Any) -> Any:
    """``new`` plus explicit ``None`` for every key ``old`` had and ``new`` lacks (RFC 7386 removals)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return new
    out = {key: merge_patch_deletions(old.get(key), value) for key, value in new.items()}
    for key in old:
        if key not in new:
            out[key] = None
    return out


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, bool) or isinstance(have, bool):
        return False
    if isinstance(want, (str, int, float)) and isinstance(have, (str, int, float)):
        try:  # the server canonicalises quantities: "1000m" -> "1", "4096Mi" -> "4Gi", 2 -> "2"
            return parse_quantity(want) == parse_quantity(have)
        except (ValueError, TypeError, ArithmeticError):
            return False
    return False


def covers(live: Any, want: Any) -> bool:
    """Whether ``live`` already has every field of ``want`` with its value (lists: same length, items
    pairwise covered). Extra live fields (server defaults, status) do not matter."""
    if isinstance(want, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(
            covers(live.get(key), value) for key, value in want.items() if value is not None or key in live
        )
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(
            covers(h, w) for h, w in zip(live, want, strict=True))
    return _same_scalar(want, live)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _stripped(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest as we compare it: our bookkeeping annotation removed."""
    out = json.loads(json.dumps(manifest))
    annotations = out.get("metadata", {}).get("annotations")
    if annotations is not None:
        annotations.pop(LAST_APPLIED, None)
        if not annotations:
            del out["metadata"]["annotations"]
    return out


def _with_last_applied(manifest: Mapping[str, Any]) -> dict[str, Any]:
    out = _stripped(manifest)
    out.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED] = _canonical(out)
    return out


def up_to_date(live: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
    """Whether applying ``manifest`` would change nothing: the live object covers it and our last-applied
    annotation equals it (so no field we stopped setting lingers). Pure: watch events use it as is."""
    return _up_to_date(live, _with_last_applied(manifest))


def _up_to_date(live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """`up_to_date` for a manifest that already carries its last-applied annotation."""
    previous = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    return previous == desired["metadata"]["annotations"][LAST_APPLIED] and covers(live, desired)


def _selector_matches(selector: Mapping[str, str], obj_labels: Mapping[str, str] | None) -> bool:
    obj_labels = obj_labels or {}
    return all(obj_labels.get(k) == v for k, v in selector.items())


def identity() -> str:
    """This process among the operator's replicas: the pod name (the chart sets POD_NAME), else host and
    PID. It names the leader-election holder and is sent as the User-Agent, so the audit log tells which
    replica made a call even though all replicas share one ServiceAccount."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def user_agent() -> str:
    return f"embedfleet-operator/{identity()}"


def load_client(kubeconfig: str | os.PathLike[str] | None = None) -> kubernetes.client.ApiClient:
    """An explicit kubeconfig, else in-cluster credentials in a pod, else ``$KUBECONFIG`` / ~/.kube/config."""
    config = kubernetes.client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=config)
    else:
        # Read $KUBECONFIG now: the client captures it at import time, before tests or CLIs set it.
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        kubernetes.config.load_kube_config(
            config_file=str(path) if path else None, client_configuration=config
        )
    client = kubernetes.client.ApiClient(configuration=config)
    client.user_agent = user_agent()
    return client


class Kube(KubeClient):
    """The operator's calls: the kit's raw calls (embedfleet/kit/client.py) plus objects by kind, apply with
    diff, owned objects and pruning. Synchronous; kopf runs sync handlers in worker threads."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None,
                 kinds: Mapping[str, Kind] = KINDS, timeout: tuple[float, float] = TIMEOUT) -> None:
        super().__init__(api_client, timeout=timeout, factory=load_client)
        #: The kinds this client can address by name (``KINDS`` unless a caller narrows or extends it):
        #: given at construction, never changed by an import elsewhere.
        self.kinds: Mapping[str, Kind] = dict(kinds)
        self._discovery: dict[tuple[str, str], tuple[bool, float]] = {}

    # ------------------------------------------------------------ objects

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return self.request("GET", self.kinds[kind].path(namespace, name), allow_404=True)

    def get_metadata(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """Only the object's metadata (PartialObjectMetadata): for a Secret, its labels without its data,
        so a value never enters this process (or its logs)."""
        return self.request(
            "GET",
            self.kinds[kind].path(namespace, name),
            allow_404=True,
            accept="application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1",
        )

    def list(
        self, kind: str, namespace: str | None = None, selector: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Objects of a kind; the label selector is also applied here, since not every server honours it."""
        selector = dict(selector or {})
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in selector.items()))] if selector else []
        data = self.request("GET", self.kinds[kind].path(namespace), query=query)
        items = data.get("items", []) if data else []
        return [item for item in items if _selector_matches(selector, item.get("metadata", {}).get("labels"))]

    def apply(self, manifest: Mapping[str, Any], live: Any = _READ) -> ApplyResult:
        """Create, patch or leave alone; see the module docstring for why this issues no idle writes.

        ``live`` may pass the object as just seen (a watch event), None when it is known to be gone, or
        be left out to read it here."""
        return self.apply_object(manifest, live)[0]

    def apply_object(self, manifest: Mapping[str, Any], live: Any = _READ) -> tuple[ApplyResult, dict[str, Any]]:
        """`apply`, and the object as the server answered (``live`` itself when unchanged): its
        resourceVersion tells a watcher when its view includes this write."""
        kind = self.kinds[manifest["kind"]]
        meta = manifest["metadata"]
        name, namespace = meta["name"], meta.get("namespace")
        desired = _with_last_applied(manifest)
        if live is _READ:
            live = self.get(manifest["kind"], name, namespace)
        if live is None:
            created = self.request("POST", kind.path(namespace), body=desired)
            log.info("created %s %s/%s", manifest["kind"], namespace or "-", name)
            return "created", created
        if not owned_by_us(live, manifest):
            raise NotOwned(manifest["kind"], namespace, name)
        if _up_to_date(live, desired):
            return "unchanged", live
        previous_text = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
        previous = json.loads(previous_text) if previous_text else {}
        patch = merge_patch_deletions(previous, desired)
        patched = self.request("PATCH", kind.path(namespace, name), body=patch, content_type=MERGE_PATCH)
        log.info("patched %s %s/%s", manifest["kind"], namespace or "-", name)
        return "patched", patched

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        return self.request("POST", self.kinds[manifest["kind"]].path(meta.get("namespace")), body=dict(manifest))

    def delete(self, kind: str, name: str, namespace: str | None = None) -> bool:
        """True when something was deleted; a missing object is already the desired state."""
        return self.delete_object(kind, name, namespace) is not None

    def delete_object(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """`delete`, returning the server's answer (the object, with its deletionTimestamp while finalizers
        hold it) or None when it was already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        result = self.request("DELETE", self.kinds[kind].path(namespace, name), body=body, allow_404=True)
        if result is not None:
            log.info("deleted %s %s/%s", kind, namespace or "-", name)
        return result

    def patch_merge(
        self,
        kind: str,
        name: str,
        namespace: str | None,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return self.request(
            "PATCH",
            self.kinds[kind].path(namespace, name, subresource),
            body=dict(patch),
            content_type=MERGE_PATCH,
        )

    def patch_status(self, kind: str, name: str, namespace: str | None, status: Mapping[str, Any]) -> dict[str, Any]:
        """The object as written (its ``resourceVersion`` tells when a watch has caught up with the write)."""
        return self.patch_merge(kind, name, namespace, {"status": dict(status)}, subresource="status")

    def has_resource(self, api_version: str, plural: str) -> bool:
        """Whether the server serves a resource (e.g. ServiceMonitor only where its CRD is installed).

        Discovery is cached for DISCOVERY_TTL seconds: reconciles do not probe (or 404 on) a kind
        that is absent every time, and a CRD installed later is noticed within the TTL."""
        key = (api_version, plural)
        now = time.monotonic()
        cached = self._discovery.get(key)
        if cached is not None and now - cached[1] < DISCOVERY_TTL:
            return cached[0]
        path = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
        try:
            data = self.request("GET", path, allow_404=True)
        except KubeError:
            return False
        served = bool(data) and any(r.get("name") == plural for r in data.get("resources", []))
        self._discovery[key] = (served, now)
        return served

    def event(self, involved: Mapping[str, Any], reason: str, message: str, type_: str = "Normal") -> None:
        """A core/v1 Event about an object, for callers outside a kopf handler (kopf has its own)."""
        meta = involved["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = meta.get("namespace") or "default"
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "reason": reason[:128],
            "message": message[:1024],
            "type": type_,
            "source": {"component": naming.MANAGED_BY},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.request("POST", self.kinds["Event"].path(namespace), body=body)

    # ------------------------------------------------------------ ownership

    def owned(
        self,
        owner_kind: str,
        owner_name: str,
        owner_uid: str | None,
        namespace: str,
        kinds: tuple[str, ...] = OWNED_KINDS,
    ) -> list[tuple[str, dict[str, Any]]]:
        """Objects labelled as ours for this owner; namespaced ones must also carry its owner reference."""
        found: list[tuple[str, dict[str, Any]]] = []
        for kind in kinds:
            info = self.kinds[kind]
            if "." in info.api_version.split("/")[0] and not self.has_resource(info.api_version, info.plural):
                continue  # an optional kind (e.g. ServiceMonitor) whose CRD is not installed here
            selector = {naming.INSTANCE_LABEL: owner_name, naming.MANAGED_BY_LABEL: naming.MANAGED_BY}
            if not info.namespaced:
                selector[naming.OWNER_NAMESPACE_LABEL] = namespace
                selector[naming.OWNER_KIND_LABEL] = owner_kind.lower()
            try:
                items = self.list(kind, namespace if info.namespaced else None, selector)
            except KubeError as exc:
                if exc.status == 404:  # e.g. no ServiceMonitor CRD on this cluster
                    continue
                raise
            for item in items:
                refs = item.get("metadata", {}).get("ownerReferences") or []
                if (
                    info.namespaced
                    and owner_uid is not None
                    and not any(r.get("uid") == owner_uid for r in refs)
                ):
                    continue
                found.append((kind, item))
        return found

    def prune(
        self,
        owner_kind: str,
        owner_name: str,
        owner_uid: str | None,
        namespace: str,
        keep: list[Mapping[str, Any]],
        kinds: tuple[str, ...] = OWNED_KINDS,
    ) -> list[str]:
        """Delete our objects for this owner that are not in ``keep``; returns ``Kind/name`` of each."""
        wanted = {(m["kind"], m["metadata"]["name"]) for m in keep}
        deleted = []
        for kind, item in self.owned(owner_kind, owner_name, owner_uid, namespace, kinds):
            name = item["metadata"]["name"]
            if (kind, name) not in wanted and self.delete(kind, name, item["metadata"].get("namespace")):
                deleted.append(f"{kind}/{name}")
        return deleted
