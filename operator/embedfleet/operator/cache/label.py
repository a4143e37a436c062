"""Tell the scheduler a node holds a model: label it ``cache.embedfleet.dev/<12 hex>=ready``.

Runtime pods prefer (or require) nodes with this label, so the label is written only after the
cache entry's ready marker exists.
"""

from __future__ import annotations

import os

import kubernetes

from .digest import parse_digest

LABEL_PREFIX = "cache.embedfleet.dev/"


def label_key(digest: str) -> str:
    return LABEL_PREFIX + parse_digest(digest)[:12]


def _api() -> kubernetes.client.CoreV1Api:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config()
    return kubernetes.client.CoreV1Api()


def label_node(node_name: str, digest: str, value: str = "ready") -> dict[str, str]:
    """Merge-patch one label onto the node; return the node's labels as the API server now has them."""
    node = _api().patch_node(node_name, {"metadata": {"labels": {label_key(digest): value}}})
    return dict(node.metadata.labels or {})
