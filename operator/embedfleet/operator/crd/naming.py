"""Names shared by the CRDs, the renderer, the cache puller and the autoscaler.

They are a contract between processes (the operator, the ``embedfleet cache pull`` DaemonSet, the
runtime pods), so they live in one place instead of being spelled out where they are used.
"""

from __future__ import annotations

import re

GROUP = "embedfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

EMBEDDING_DEPLOYMENT_KIND = "EmbeddingDeployment"
EMBEDDING_DEPLOYMENT_PLURAL = "embeddingdeployments"
EMBEDDING_DEPLOYMENT_SINGULAR = "embeddingdeployment"
EMBEDDING_DEPLOYMENT_SHORT_NAMES = ("embdep", "ed")

MODEL_CACHE_KIND = "ModelCache"
MODEL_CACHE_PLURAL = "modelcaches"
MODEL_CACHE_SINGULAR = "modelcache"
MODEL_CACHE_SHORT_NAMES = ("mcache",)

#: Label set on every object the operator renders; the value is the owning EmbeddingDeployment's name.
INSTANCE_LABEL = "embedfleet.dev/deployment"
#: Label naming the component inside one deployment (runtime, prepull).
COMPONENT_LABEL = "embedfleet.dev/component"
#: On cluster-scoped objects, which can carry no owner reference to a namespaced owner.
OWNER_NAMESPACE_LABEL = "embedfleet.dev/namespace"
OWNER_KIND_LABEL = "embedfleet.dev/owner-kind"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "embedfleet-operator"

#: Node labels written by ``embedfleet cache pull --label-node`` once a digest is verified on disk:
#: ``cache.embedfleet.dev/sha256-<first 16 hex digits>=ready``.
CACHE_LABEL_PREFIX = "cache.embedfleet.dev/"
CACHE_LABEL_READY = "ready"
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


def digest_hex(digest: str) -> str:
    """The 64 hex digits of a ``sha256:`` digest; ValueError for anything else."""
    match = _DIGEST.match(digest)
    if match is None:
        raise ValueError(f"digest must look like sha256:<64 lowercase hex digits>, got {digest!r}")
    return match.group(1)


def cache_label_key(digest: str) -> str:
    """The node label key that says a node holds these weights (16 hex digits keep it under 63 chars)."""
    return f"{CACHE_LABEL_PREFIX}sha256-{digest_hex(digest)[:16]}"


def cache_subdir(digest: str) -> str:
    """Directory, relative to the node cache root, holding one model's files: ``sha256-<64 hex>``."""
    return f"sha256-{digest_hex(digest)}"
