"""Shared by every rendered object: object metadata (names, labels, owner references), selectors, the
non-root security contexts and the content hash. Each per-kind module imports from here and from
nothing else of the renderer but ``revisions``, so there is one place to change what all objects share.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from embedfleet.operator.crd import naming

Manifest = dict[str, Any]

RUNTIME_UID = 10001
CONFIG_HASH_ANNOTATION = "embedfleet.dev/config-hash"


def owner_reference(name: str, uid: str, kind: str = naming.EMBEDDING_DEPLOYMENT_KIND) -> dict[str, Any]:
    return {
        "apiVersion": naming.API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "embedfleet",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        naming.MANAGED_BY_LABEL: naming.MANAGED_BY,
        naming.INSTANCE_LABEL: name,
        naming.COMPONENT_LABEL: component,
    }


def selector_labels(name: str, component: str) -> dict[str, str]:
    """The immutable subset used in selectors (a Deployment's selector can never change)."""
    return {naming.INSTANCE_LABEL: name, naming.COMPONENT_LABEL: component}


def selector_string(name: str, component: str = "runtime") -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name, component).items())


def _meta(name: str, namespace: str, owner: dict[str, Any] | None, lbls: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(lbls)}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def content_hash(obj: Any) -> str:
    """Stable short hash of JSON-able data (key order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _non_root_container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def runtime_name(name: str) -> str:
    return name


def config_map_name(name: str) -> str:
    return f"{name}-config"
