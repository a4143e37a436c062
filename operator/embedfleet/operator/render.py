"""EmbeddingDeployment spec -> the Kubernetes objects that run it. Pure: no I/O, no clock, no kopf.

Everything the operator creates is decided here, so a reader (or a test) can see the whole cluster
footprint of one spec by calling `render`. Every object is namespaced and carries an owner reference to
the custom resource, so the API server's garbage collector removes it with its owner. Nothing rendered
here holds a node right: pre-pulling is the chart's node agent's job (`embedfleet cache agent`, one
DaemonSet in the operator's namespace), which reads the same specs and fills the node cache.

Model files reach the runtime in one of three ways, and ``EMBEDFLEET_MODEL`` points at the result:

* downloaded (hf, http(s)): an init container runs ``embedfleet cache pull`` into a pod-local emptyDir
  mounted at ``/var/cache/embedfleet/local``; ``EMBEDFLEET_MODEL`` is ``local/sha256-<hex>`` and
  ``EMBEDFLEET_MODEL_DIGEST`` the digest the runtime re-verifies before loading. With pre-pull on, the
  pod also mounts its tenant's node cache entry ``<platform cache root>/<namespace>_sha256-<hex>``
  read-only at ``/var/cache/embedfleet/node``: when the agent has filled it, the init container only
  links ``local/sha256-<hex>`` to it (no download); runtime pods prefer (or require) nodes labelled
  ``cache.embedfleet.dev/t<tenant>-sha256-<16 hex>=ready``;
* ``file://`` (a path inside the image) and ``pvc://claim/path`` (mounted read-only) are used in place.

Every runtime pod is kept off control-plane nodes (a required node-affinity term) unless the platform
allows them. Runtime and init containers run ``spec.runtime.image``, else the platform's default image
(``default_image``; see ``platform.runtime_image``): a new default re-renders, and so rolls, the pods of
every deployment that names no image.
"""

from __future__ import annotations

import hashlib
import json
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from embedfleet.compat.identity import identity
from embedfleet.compat.names import with_revision
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.gpus import GPU_PRODUCT_LABEL, KNOWN_GPU_TYPES
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, ModelSource
from embedfleet.operator.crd.prepull import pull_source
from embedfleet.operator.platform import CONTROL_PLANE_LABELS, runtime_image
from embedfleet.operator.rollout.revisions import Run

Manifest = dict[str, Any]

RUNTIME_UID = 10001
CONTAINER_CACHE_DIR = "/var/cache/embedfleet"
#: The pod's own copy (an emptyDir), or links into the node cache: what EMBEDFLEET_MODEL points into.
LOCAL_CACHE_DIR = f"{CONTAINER_CACHE_DIR}/local"
#: The tenant's node cache entry, read-only (pre-pull only).
NODE_CACHE_DIR = f"{CONTAINER_CACHE_DIR}/node"
PVC_MOUNT_DIR = "/models/pvc"
#: spec.runtime.apiKeysSecret's key, mounted read-only (a secret volume); EMBEDFLEET_API_KEYS names the file.
API_KEYS_DIR = "/etc/embedfleet/api-keys"
API_KEYS_FILE = "keys.yaml"
#: Owner and group read (the pod's fsGroup is the group): the runtime reads it, nobody else in the pod.
API_KEYS_MODE = 0o440
#: Seconds preStop waits so endpoints drop the pod before SIGTERM starts the runtime's drain.
PRESTOP_SLEEP_SECONDS = 5
#: Margin on top of preStop + drain so the kubelet never SIGKILLs a pod that is still draining.
GRACE_MARGIN_SECONDS = 10
SERVICE_PORT = 80
CONFIG_HASH_ANNOTATION = "embedfleet.dev/config-hash"


# ---------------------------------------------------------------- small helpers


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


# ---------------------------------------------------------------- revisions (docs/rollouts.md)

#: The first revision of a deployment that has no status yet: r1, in vector space r1.
FIRST_REVISION = "r1"
#: Pod component of a revision that runs beside the primary Deployment (a candidate or side by side):
#: the primary's selector, status.selector, the PDB and the autoscaler never see its pods.
REVISION_COMPONENT = "revision"


def default_runs(spec: EmbeddingDeploymentSpec) -> list[Run]:
    """Before status records any revision: the spec's identity is r1, alone in vector space r1."""
    return [Run(FIRST_REVISION, identity(spec), FIRST_REVISION, True)]


def revision_object_name(name: str, revision: str) -> str:
    """``<name>-rN``: the Deployment and Service of a revision that is not the current one."""
    return f"{name}-{revision}"


def revision_config_map_name(name: str, revision: str) -> str:
    return f"{revision_object_name(name, revision)}-config"


def spec_for(spec: EmbeddingDeploymentSpec, ident: Mapping[str, Any]) -> EmbeddingDeploymentSpec:
    """The spec with a revision's identity fields (model source, revision, digest, dtype, quantization,
    engine) in place of its own: everything else (replicas, limits, placement) is the spec's."""
    model = spec.model.model_copy(update={"source": ident["source"], "revision": ident.get("modelRevision"),
                                          "digest": ident.get("digest")})
    runtime = spec.runtime.model_copy(update={"dtype": ident.get("dtype") or spec.runtime.dtype,
                                              "quantization": ident.get("quantization") or spec.runtime.quantization,
                                              "engine": ident.get("engine") or spec.runtime.engine})
    return spec.model_copy(update={"model": model, "runtime": runtime})


def revision_labels(run: Run) -> dict[str, str]:
    return {naming.REVISION_LABEL: run.revision, naming.VECTOR_SPACE_LABEL: run.vector_space}


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


def effective_replicas(spec: EmbeddingDeploymentSpec, autoscaler_desired: int | None) -> int:
    """Replicas to render: the autoscaler's last decision when it made one, else the spec's own count.

    Rendering the autoscaler's number (instead of leaving the field out) keeps re-applying a changed spec
    from snapping the fleet back to minReplicas.
    """
    auto = spec.autoscaling
    if not auto.enabled:
        return spec.replicas if spec.replicas is not None else auto.min_replicas
    floor = 0 if auto.scale_to_zero else auto.min_replicas
    start = (
        autoscaler_desired
        if autoscaler_desired is not None
        else (
            spec.replicas
            if spec.replicas is not None
            else max(auto.min_replicas, 0 if auto.scale_to_zero else 1)
        )
    )
    return max(floor, min(auto.max_replicas, start))


# ---------------------------------------------------------------- runtime pieces


def runtime_env(name: str, spec: EmbeddingDeploymentSpec, platform_env: Mapping[str, str] | None = None,
                run: Run | None = None) -> dict[str, str]:
    """The runtime's configuration contract (EMBEDFLEET_* variables), as ConfigMap data; `platform_env`
    is what the platform sets for every runtime (tracing: operator/runtime_tracing.py), never the spec.
    ``run`` is the revision it serves (default: r1 in vector space r1): the runtime answers ``<served>``
    and ``<served>@rN``, refuses requests pinned to another vector space, and re-checks its probe every
    probeIntervalSeconds against minCosine."""
    run = run or default_runs(spec)[0]
    spec = spec_for(spec, run.identity)
    rt = spec.runtime
    env = {
        "EMBEDFLEET_MODEL": model_dir(spec.model),
        "EMBEDFLEET_SERVED_MODEL_NAME": spec.model.served_model_name or name,
        "EMBEDFLEET_HOST": "0.0.0.0",  # inside the pod network namespace; the Service is the only way in
        "EMBEDFLEET_PORT": str(rt.port),
        "EMBEDFLEET_DEVICE": "cuda" if rt.gpu.count > 0 else "cpu",
        "EMBEDFLEET_DTYPE": "fp8" if rt.quantization == "fp8" else rt.dtype,
        "EMBEDFLEET_ENGINE": rt.engine,
        "EMBEDFLEET_MAX_BATCH_TOKENS": str(rt.max_batch_tokens),
        "EMBEDFLEET_MAX_BATCH_REQUESTS": str(rt.max_batch_requests),
        "EMBEDFLEET_MAX_CLIENT_BATCH_SIZE": str(rt.max_client_batch_size),
        "EMBEDFLEET_MAX_CONCURRENT_REQUESTS": str(rt.max_concurrent_requests),
        "EMBEDFLEET_DRAIN_TIMEOUT": str(rt.drain_timeout_seconds),
        "EMBEDFLEET_REVISION": run.revision,
        "EMBEDFLEET_VECTOR_SPACE": run.vector_space,
        "EMBEDFLEET_PROBE_INTERVAL": f"{spec.rollout.probe_interval_seconds:g}",
        "EMBEDFLEET_PROBE_MIN_COSINE": f"{spec.rollout.min_cosine:g}",
    }
    optional = {
        "EMBEDFLEET_MAX_INPUT_TOKENS": rt.max_input_tokens,
        "EMBEDFLEET_PAYLOAD_LIMIT": rt.payload_limit,
        "EMBEDFLEET_TOKENIZER_WORKERS": rt.tokenizer_workers,
        # the same bounds the gateway sheds by for this deployment (gateway/bounds.py)
        "EMBEDFLEET_MAX_QUEUE_SECONDS": rt.max_queue_seconds,
        "EMBEDFLEET_MAX_QUEUE_SECONDS_BULK": rt.max_queue_seconds_bulk,
    }
    env.update({key: str(value) for key, value in optional.items() if value is not None})
    if downloaded(spec.model) and spec.model.digest is not None:
        env["EMBEDFLEET_MODEL_DIGEST"] = spec.model.digest  # the runtime verifies before loading
    if platform_env:
        env.update(platform_env)
        if "OTEL_SERVICE_NAME" not in platform_env:
            env["OTEL_SERVICE_NAME"] = "embedfleet-runtime"
        # which deployment a span came from, after whatever the platform set
        attributes = [a for a in (platform_env.get("OTEL_RESOURCE_ATTRIBUTES", ""),
                                  f"embedfleet.deployment={name}") if a]
        env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(attributes)
    return env


def render_config_map(name: str, namespace: str, uid: str, spec: EmbeddingDeploymentSpec,
                      platform_env: Mapping[str, str] | None = None, run: Run | None = None) -> Manifest:
    run = run or default_runs(spec)[0]
    cm_name = config_map_name(name) if run.primary else revision_config_map_name(name, run.revision)
    component = "runtime" if run.primary else REVISION_COMPONENT
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cm_name, namespace, owner_reference(name, uid), labels(name, component)),
        "data": runtime_env(name, spec, platform_env, run),
    }


def _affinity(spec: EmbeddingDeploymentSpec, namespace: str, allow_control_plane: bool) -> dict[str, Any] | None:
    required: list[dict[str, Any]] = []
    preferred: list[dict[str, Any]] = []
    if not allow_control_plane:
        # the current label only: an affinity on the removed `master` label draws an API warning per pod
        required.append({"key": CONTROL_PLANE_LABELS[0], "operator": "DoesNotExist"})
    gpu = spec.runtime.gpu
    if gpu.count > 0 and gpu.type is not None:
        required.append(
            {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(KNOWN_GPU_TYPES[gpu.type])}
        )
    if spec.cache.pre_pull and spec.model.digest is not None:
        cached = {
            "key": naming.cache_label_key(spec.model.digest, namespace),
            "operator": "In",
            "values": [naming.CACHE_LABEL_READY],
        }
        if spec.cache.require_cached_node:
            required.append(cached)
        else:
            preferred.append({"weight": 100, "preference": {"matchExpressions": [cached]}})
    if not required and not preferred:
        return None
    node_affinity: dict[str, Any] = {}
    if required:
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": [{"matchExpressions": required}]
        }
    if preferred:
        node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return {"nodeAffinity": node_affinity}


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
    spec: EmbeddingDeploymentSpec, namespace: str, cache_root: str, image: str
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
        # The tenant's own entry, never the root: DirectoryOrCreate makes the kubelet create it (empty,
        # root-owned) when the pod lands before the agent; the agent replaces it with the weights.
        entry = cache_root.rstrip("/") + "/" + naming.cache_entry(namespace, spec.model.digest)
        volumes.append({"name": "node-cache", "hostPath": {"path": entry, "type": "DirectoryOrCreate"}})
        node_mount = {"name": "node-cache", "mountPath": NODE_CACHE_DIR, "readOnly": True}
        runtime_mounts.append(node_mount)
        init_mounts.append(node_mount)
        command += ["--from-node-cache", NODE_CACHE_DIR]
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


def _resources(spec: EmbeddingDeploymentSpec) -> dict[str, Any]:
    requests = dict(spec.runtime.resources.requests)
    limits = dict(spec.runtime.resources.limits)
    if spec.runtime.gpu.count > 0:
        requests["nvidia.com/gpu"] = str(spec.runtime.gpu.count)
        limits["nvidia.com/gpu"] = str(spec.runtime.gpu.count)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def rollout_strategy(spec: EmbeddingDeploymentSpec) -> dict[str, Any]:
    """Surge when pods are cheap; replace in place when they hold GPUs.

    A surge pod for a GPU runtime needs a spare GPU, and with ``maxUnavailable: 0`` a cluster with
    exactly enough GPUs deadlocks the rollout for ever (the new pod stays Pending, no old pod is
    removed). So GPU runtimes roll one pod at a time with no surge: capacity dips by one replica during
    a rollout instead of never finishing it.
    """
    if spec.runtime.gpu.count > 0:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}


def render_deployment(
    name: str,
    namespace: str,
    uid: str,
    spec: EmbeddingDeploymentSpec,
    replicas: int,
    config_hash: str,
    *,
    cache_root: str,
    allow_control_plane: bool = False,
    run: Run | None = None,
    default_image: str | None = None,
) -> Manifest:
    """The runtime Deployment of one revision: the primary ``<name>`` (the current revision) or
    ``<name>-rN`` (a candidate or side-by-side revision, component ``revision``). ``default_image`` is
    the platform's runtime image for a spec that names none."""
    run = run or default_runs(spec)[0]
    spec = spec_for(spec, run.identity)
    if run.primary:
        object_name, component, config_name = runtime_name(name), "runtime", config_map_name(name)
        selector = selector_labels(name, component)
    else:
        object_name, component = revision_object_name(name, run.revision), REVISION_COMPONENT
        config_name = revision_config_map_name(name, run.revision)
        selector = {**selector_labels(name, component), naming.REVISION_LABEL: run.revision}
    rt = spec.runtime
    image = runtime_image(rt.image, default_image)
    volumes, mounts, init_containers = _model_volumes(spec, namespace, cache_root, image)
    volumes = [{"name": "tmp", "emptyDir": {}}, *volumes]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
    ]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, *mounts]
    if rt.api_key_secret is not None:
        env.append(
            {
                "name": "EMBEDFLEET_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": rt.api_key_secret.name, "key": rt.api_key_secret.key}},
            }
        )
    if rt.api_keys_secret is not None:
        # The runtime reads the file at start-up only: a changed Secret reaches pods on their next rollout.
        # (A content hash would mean reading the Secret's data, which the operator never does.)
        volumes.append(
            {
                "name": "api-keys",
                "secret": {
                    "secretName": rt.api_keys_secret.name,
                    "items": [{"key": rt.api_keys_secret.key, "path": API_KEYS_FILE}],
                    "defaultMode": API_KEYS_MODE,
                },
            }
        )
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        env.append({"name": "EMBEDFLEET_API_KEYS", "value": f"{API_KEYS_DIR}/{API_KEYS_FILE}"})
    container = {
        "name": "runtime",
        "image": image,
        "imagePullPolicy": rt.image_pull_policy,
        "command": ["embedfleet", "serve"],
        "ports": [{"name": "http", "containerPort": rt.port, "protocol": "TCP"}],
        "envFrom": [{"configMapRef": {"name": config_name}}],
        "env": env,
        "resources": _resources(spec),
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 120,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "securityContext": _non_root_container_security(),
        "volumeMounts": mounts,
    }
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in rt.tolerations]
    if rt.gpu.count > 0:
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    pod_spec: dict[str, Any] = {
        "securityContext": _pod_security(),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_SECONDS
        + rt.drain_timeout_seconds
        + GRACE_MARGIN_SECONDS,
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector},
            }
        ],
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if rt.node_selector:
        pod_spec["nodeSelector"] = dict(rt.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    affinity = _affinity(spec, namespace, allow_control_plane)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(object_name, namespace, owner_reference(name, uid), labels(name, component)),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector},
            "strategy": rollout_strategy(spec),
            "template": {
                "metadata": {
                    "labels": {**labels(name, component), **revision_labels(run)},
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(rt.port),
                        "prometheus.io/path": "/metrics",
                        CONFIG_HASH_ANNOTATION: config_hash,
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def render_service(name: str, namespace: str, uid: str, spec: EmbeddingDeploymentSpec,
                   query_vector_space: str = FIRST_REVISION, run: Run | None = None) -> Manifest:
    """The main Service ``<name>`` (no ``run``): every runtime pod of the query vector space, whichever
    Deployment runs it, so it never mixes spaces and never reaches an ungated candidate. With a ``run``:
    the Service ``<name>-rN`` of that revision (``<served>@rN`` traffic and the drift gate's reads)."""
    served = spec.model.served_model_name or name
    if run is None:
        object_name, model, space = runtime_name(name), served, query_vector_space
        selector = {naming.INSTANCE_LABEL: name, naming.VECTOR_SPACE_LABEL: query_vector_space}
        component = "runtime"
    else:
        object_name, model, space = revision_object_name(name, run.revision), with_revision(served, run.revision), \
            run.vector_space
        selector = {naming.INSTANCE_LABEL: name, naming.REVISION_LABEL: run.revision}
        component = REVISION_COMPONENT
    meta = _meta(object_name, namespace, owner_reference(name, uid), labels(name, component))
    meta["annotations"] = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.runtime.port),
        "prometheus.io/path": "/metrics",
        naming.MODEL_ANNOTATION: model,
        naming.VECTOR_SPACE_ANNOTATION: space,
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(name: str, namespace: str, uid: str) -> Manifest:
    """At most one runtime pod voluntarily down at a time (a node drain proceeds one pod at a time)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(runtime_name(name), namespace, owner_reference(name, uid), labels(name, "runtime")),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, "runtime")}},
    }


def render_service_monitor(name: str, namespace: str, uid: str, spec: EmbeddingDeploymentSpec) -> Manifest:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(runtime_name(name), namespace, owner_reference(name, uid), labels(name, "runtime")),
        "spec": {
            "selector": {"matchLabels": selector_labels(name, "runtime")},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": spec.monitoring.scrape_interval}],
        },
    }


# ---------------------------------------------------------------- entry points


def render(
    name: str,
    namespace: str,
    uid: str,
    spec: EmbeddingDeploymentSpec,
    *,
    cache_root: str,
    allow_control_plane: bool = False,
    autoscaler_desired: int | None = None,
    service_monitor_available: bool = False,
    platform_env: Mapping[str, str] | None = None,
    runs: Sequence[Run] | None = None,
    query_vector_space: str | None = None,
    default_image: str | None = None,
) -> list[Manifest]:
    """Every object one EmbeddingDeployment needs, in apply order (config before its consumers).

    ``cache_root`` is the platform's node cache root (chart value platform.cacheRoot), never the
    tenant's; ``allow_control_plane`` lifts the rule that keeps runtime pods off control-plane nodes;
    ``platform_env`` is added to every runtime's configuration (the platform's tracing settings);
    ``default_image`` is the platform's runtime image for a spec that names none.
    ``runs`` are the revisions to run (rollout.revisions.decide; default: the spec as r1), the primary
    first, and ``query_vector_space`` the one the main Service selects (default: the primary's).
    """
    runs = list(runs or default_runs(spec))
    primary = next(r for r in runs if r.primary)
    config = render_config_map(name, namespace, uid, spec, platform_env, primary)
    replicas = effective_replicas(spec, autoscaler_desired)
    out = [
        config,
        render_deployment(name, namespace, uid, spec, replicas, content_hash(config["data"]),
                          cache_root=cache_root, allow_control_plane=allow_control_plane, run=primary,
                          default_image=default_image),
        render_service(name, namespace, uid, spec, query_vector_space or primary.vector_space),
        render_pdb(name, namespace, uid),
    ]
    for run in runs:
        if run.primary:
            continue
        side_config = render_config_map(name, namespace, uid, spec, platform_env, run)
        out += [side_config,
                render_deployment(name, namespace, uid, spec, run.replicas or 1, content_hash(side_config["data"]),
                                  cache_root=cache_root, allow_control_plane=allow_control_plane, run=run,
                                  default_image=default_image)]
        if run.revision != primary.revision:
            out.append(render_service(name, namespace, uid, spec, run=run))
    if spec.monitoring.service_monitor and service_monitor_available:
        out.append(render_service_monitor(name, namespace, uid, spec))
    return out
