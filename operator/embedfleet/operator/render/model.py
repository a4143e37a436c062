"""Where the runtime finds its model files: the volumes, mounts and ``fetch-model`` init container of the
runtime pod, and the path ``EMBEDFLEET_MODEL`` names. Kept apart from the pod template because the three
ways model files arrive (and the node cache) are their own concern, shared by the ConfigMap (the path)
and the Deployment (the volumes).

* downloaded (hf, http(s)): an init container runs ``embedfleet cache pull`` into a pod-local emptyDir
  mounted at ``/var/cache/embedfleet/local``; ``EMBEDFLEET_MODEL`` is ``local/sha256-<hex>`` and
  ``EMBEDFLEET_MODEL_DIGEST`` the digest the runtime re-verifies before loading. With pre-pull on, the
  pod also mounts its tenant's node cache entry ``<platform cache root>/<namespace>_sha256-<hex>``
  read-only at ``/var/cache/embedfleet/node``, through the claim ``embedfleet-sha256-<hex>`` in its own
  namespace (bound to a PersistentVolume the operator creates: render/cache_volumes.py), so the pod itself
  names no host path: when the agent has filled it, the init container only links ``local/sha256-<hex>``
  to it (no download);
* with pre-pull, a deployment whose runtime builds an engine (`prepull.shares_engine_builds`: int8,
  TensorRT-LLM) also mounts its tenant's engines folder ``<cache root>/<namespace>_engines-sha256-<hex>``
  (claim ``embedfleet-engines-sha256-<hex>``) writable at ``ENGINES_MOUNT`` (``EMBEDFLEET_ENGINE_CACHE_DIR``):
  the first pod on a node builds there, the next ones (and the node agent, for other nodes) reuse it
  (operator/cache/engines.py);
* ``file://`` (a path inside the image) and ``pvc://claim/path`` (mounted read-only) are used in place.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from embedfleet.operator.cache.engines import ENGINES_MOUNT
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, ModelSource
from embedfleet.operator.crd.prepull import pull_source, shares_engine_builds
from embedfleet.operator.render.common import _non_root_container_security

CONTAINER_CACHE_DIR = "/var/cache/embedfleet"
#: The pod's own copy (an emptyDir), or links into the node cache: what EMBEDFLEET_MODEL points into.
LOCAL_CACHE_DIR = f"{CONTAINER_CACHE_DIR}/local"
#: The tenant's node cache entry, read-only (pre-pull only).
NODE_CACHE_DIR = f"{CONTAINER_CACHE_DIR}/node"
PVC_MOUNT_DIR = "/models/pvc"


def model_dir(model: ModelSource) -> str:
    """Where the runtime finds the model files inside its container."""
    parsed = urllib.parse.urlsplit(model.source)
    if parsed.scheme == "file":
        return parsed.path
    if parsed.scheme == "pvc":
        return PVC_MOUNT_DIR + (parsed.path.rstrip("/") or "")
    assert model.digest is not None, "validate() requires a digest for downloaded models"
    return f"{LOCAL_CACHE_DIR}/{naming.cache_subdir(model.digest)}"


def downloaded(model: ModelSource) -> bool:
    return urllib.parse.urlsplit(model.source).scheme not in ("file", "pvc")


def _pull_args(model: ModelSource, cache_dir: str) -> list[str]:
    assert model.digest is not None
    return [
        "embedfleet",
        "cache",
        "pull",
        "--source",
        pull_source(model),
        "--digest",
        model.digest,
        "--cache-dir",
        cache_dir,
    ]


def _model_volumes(
    spec: EmbeddingDeploymentSpec, image: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, runtime volumeMounts, init containers) that put the model where model_dir() says."""
    parsed = urllib.parse.urlsplit(spec.model.source)
    if parsed.scheme == "file":
        return [], [], []
    if parsed.scheme == "pvc":
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": parsed.netloc, "readOnly": True}}
        return [volume], [{"name": "model", "mountPath": PVC_MOUNT_DIR, "readOnly": True}], []
    assert spec.model.digest is not None
    empty_dir: dict[str, Any] = {}
    if spec.cache.storage.size_limit is not None:
        empty_dir["sizeLimit"] = spec.cache.storage.size_limit
    volumes: list[dict[str, Any]] = [{"name": "model-cache", "emptyDir": empty_dir}]
    runtime_mounts = [{"name": "model-cache", "mountPath": LOCAL_CACHE_DIR, "readOnly": True}]
    init_mounts = [{"name": "model-cache", "mountPath": LOCAL_CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    command = _pull_args(spec.model, LOCAL_CACHE_DIR)
    if spec.cache.pre_pull:
        # The tenant's own entry, never the root, through its claim (the volume is DirectoryOrCreate: the
        # kubelet creates it, empty and root-owned, when the pod lands before the agent, which replaces it).
        claim = {"claimName": naming.cache_claim(spec.model.digest), "readOnly": True}
        volumes.append({"name": "node-cache", "persistentVolumeClaim": claim})
        node_mount = {"name": "node-cache", "mountPath": NODE_CACHE_DIR, "readOnly": True}
        runtime_mounts.append(node_mount)
        init_mounts.append(node_mount)
        command += ["--from-node-cache", NODE_CACHE_DIR]
    if shares_engine_builds(spec):
        # Writable, and only by the runtime container: the tenant's builds of this model on this node. The
        # agent creates it owned by the runtime's uid; where the pod came first, the kubelet made it root-owned
        # and the runtime builds in its own /tmp until the agent has replaced it (the next pod uses it).
        engines = {"claimName": naming.engines_claim(spec.model.digest)}
        volumes.append({"name": "node-engines", "persistentVolumeClaim": engines})
        runtime_mounts.append({"name": "node-engines", "mountPath": ENGINES_MOUNT})
    init = {
        "name": "fetch-model",
        "image": image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": command,
        "env": [{"name": "HOME", "value": "/tmp"}],
        "securityContext": _non_root_container_security(),
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": init_mounts,
    }
    return volumes, runtime_mounts, [init]
