"""Tell the scheduler a node holds a model: label it ``cache.embedfleet.dev/sha256-<16 hex>=ready``.

Runtime pods prefer (or require) nodes with this label, so the label is written only after the
cache entry's ready marker exists.
"""

from __future__ import annotations

import os

import kubernetes

from embedfleet.operator.crd import naming


def label_key(digest: str) -> str:
    """The key is shared with the renderer's node affinity, so it comes from one place."""
    return naming.cache_label_key(digest)


def _api() -> kubernetes.client.CoreV1Api:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config()
    return kubernetes.client.CoreV1Api()


def label_node(node_name: str, digest: str, value: str = naming.CACHE_LABEL_READY) -> dict[str, str]:
    """Merge-patch one label onto the node; return the node's labels as the API server now has them."""
    node = _api().patch_node(node_name, {"metadata": {"labels": {label_key(digest): value}}})
    return dict(node.metadata.labels or {})
