"""Names shared by the CRDs, the renderer, the cache puller and the autoscaler.

They are a contract between processes (the operator, the ``embedfleet cache pull`` DaemonSet, the
runtime pods), so they live in one place instead of being spelled out where they are used.
"""

from __future__ import annotations

import hashlib
import re

# The API's coordinates have their home in the common package (the gateway reads them too, without the
# operator); re-exported here for the operator's modules.
from embedfleet.api_group import (  # noqa: F401
    API_VERSION,
    EMBEDDING_DEPLOYMENT_KIND,
    EMBEDDING_DEPLOYMENT_PLURAL,
    EMBEDDING_DEPLOYMENT_SHORT_NAMES,
    EMBEDDING_DEPLOYMENT_SINGULAR,
    GROUP,
    MODEL_CACHE_KIND,
    MODEL_CACHE_PLURAL,
    MODEL_CACHE_SHORT_NAMES,
    MODEL_CACHE_SINGULAR,
    VERSION,
)

#: Label set on every object the operator renders; the value is the owning EmbeddingDeployment's name.
INSTANCE_LABEL = "embedfleet.dev/deployment"
#: Label naming the component inside one deployment (runtime, prepull).
COMPONENT_LABEL = "embedfleet.dev/component"
#: On cluster-scoped objects, which can carry no owner reference to a namespaced owner.
#: Pod label: the revision (r1, r2, ...) a runtime pod serves (docs/rollouts.md).
REVISION_LABEL = "embedfleet.dev/revision"
#: Pod label and Service annotation: the vector space a runtime pod's vectors belong to.
VECTOR_SPACE_LABEL = "embedfleet.dev/vector-space"
#: Service annotation: the model name the Service answers (``<served>`` or ``<served>@rN``).
MODEL_ANNOTATION = "embedfleet.dev/model"
#: On a spoke's copy of an EmbeddingDeployment: the revision name the hub gave the spec's identity (and,
#: optionally, the vector space the hub recorded for it).
REVISION_ANNOTATION = "embedfleet.dev/revision"
VECTOR_SPACE_ANNOTATION = "embedfleet.dev/vector-space"
OWNER_NAMESPACE_LABEL = "embedfleet.dev/namespace"
OWNER_KIND_LABEL = "embedfleet.dev/owner-kind"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "embedfleet-operator"
#: ``MANAGED_BY_LABEL`` on a spoke's copy of a hub EmbeddingDeployment (hub/convert.py writes it).
HUB_MANAGED_BY = "embedfleet-hub"

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


def tenant_tag(namespace: str) -> str:
    """10 hex digits naming a tenant (namespace) inside a node label key, which has no room for 63."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:10]


def cache_label_key(digest: str, namespace: str) -> str:
    """The node label key that says a node holds these weights *for this namespace*:
    ``cache.embedfleet.dev/t<10 hex of namespace>-sha256-<16 hex>`` (44 characters after the prefix).

    Per tenant because each namespace has its own cache entry (one tenant's pods never see another
    tenant's files, not even the same digest), so "team-a holds it" says nothing about team-b.
    """
    return f"{CACHE_LABEL_PREFIX}t{tenant_tag(namespace)}-sha256-{digest_hex(digest)[:16]}"


def engines_entry(namespace: str, digest: str) -> str:
    """A tenant's engine builds for one model, beside its weights: ``<namespace>_engines-sha256-<64 hex>``
    (flat for the same reason as `cache_entry`; operator/cache/engines.py has the layout inside)."""
    return f"{namespace}_engines-{cache_subdir(digest)}"


def engine_label_key(digest: str, namespace: str, accelerator: str) -> str:
    """The node label key that says a node holds engine builds of this tenant's model for this accelerator:
    ``cache.embedfleet.dev/e<10 hex of namespace>-<16 hex of digest>-<8 hex of accelerator>`` (37 characters
    after the prefix); peers are found by it the way weights are found by `cache_label_key`."""
    accel = hashlib.sha256(accelerator.encode()).hexdigest()[:8]
    return f"{CACHE_LABEL_PREFIX}e{tenant_tag(namespace)}-{digest_hex(digest)[:16]}-{accel}"


def cache_subdir(digest: str) -> str:
    """Directory name of one model's files: ``sha256-<64 hex>``."""
    return f"sha256-{digest_hex(digest)}"


def cache_entry(namespace: str, digest: str) -> str:
    """A tenant's cache entry, relative to the platform's cache root: ``<namespace>_sha256-<64 hex>``.

    Flat, not ``<namespace>/sha256-...``: the kubelet creates a missing hostPath directory *and its
    parents* owned by root, so a runtime pod that lands on a node before the node agent would leave a
    root-owned ``<namespace>/`` the non-root agent could never write into. A root-owned empty entry in
    the agent-owned root is harmless: the agent replaces it with an atomic rename. ``_`` never occurs
    in a namespace name, so the name splits back unambiguously.
    """
    return f"{namespace}_{cache_subdir(digest)}"


#: Runtime pods reach their tenant's node-cache entries through claims in the tenant's namespace, each
#: pre-bound to one cluster-scoped PersistentVolume the operator creates (render/cache_volumes.py).
CACHE_CLAIM_PREFIX = "embedfleet-"
CACHE_VOLUME_PREFIX = "embedfleet."


def cache_claim(digest: str) -> str:
    """The claim, in the tenant's namespace, for its weights entry: ``embedfleet-sha256-<64 hex>``."""
    return CACHE_CLAIM_PREFIX + cache_subdir(digest)


def engines_claim(digest: str) -> str:
    """The claim for the tenant's engine builds of one model: ``embedfleet-engines-sha256-<64 hex>``."""
    return f"{CACHE_CLAIM_PREFIX}engines-{cache_subdir(digest)}"


def claim_entry(namespace: str, claim: str) -> str:
    """The cache entry a claim gives, relative to the cache root: ``<namespace>_`` and the claim's name
    without its prefix (`cache_entry`, `engines_entry`). The chart's policy checks the same relation."""
    return f"{namespace}_{claim.removeprefix(CACHE_CLAIM_PREFIX)}"


def cache_volume(namespace: str, claim: str) -> str:
    """The PersistentVolume pre-bound to ``claim`` in ``namespace``: ``embedfleet.<namespace>.<claim>``.
    Namespaces hold no dots, so the name says which claim alone may bind it (the chart's policy holds the
    operator to it, and refuses a claim elsewhere that names it)."""
    return f"{CACHE_VOLUME_PREFIX}{namespace}.{claim}"
