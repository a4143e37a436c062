"""The runtime Deployment of one revision: its pod template (container, probes, volumes, API keys,
security, grace period), its placement (node affinity, tolerations, spread), its rollout strategy and
its replica count. The model volumes come from ``model``, the settings from the ConfigMap (``config``),
named here and hashed into the template so a changed setting rolls the pods.

Every runtime pod is kept off control-plane nodes (a required node-affinity term) unless the platform
allows them. Runtime and init containers run ``spec.runtime.image``, else the platform's default image
(``default_image``; see ``platform.runtime_image``): a new default re-renders, and so rolls, the pods of
every deployment that names no image. With pre-pull on, runtime pods prefer (or require) nodes labelled
``cache.embedfleet.dev/t<tenant>-sha256-<16 hex>=ready``.
"""

from __future__ import annotations

from typing import Any

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.gpus import GPU_PRODUCT_LABEL, KNOWN_GPU_TYPES
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.platform import CONTROL_PLANE_LABELS, runtime_image
from embedfleet.operator.render.common import (
    CONFIG_HASH_ANNOTATION,
    Manifest,
    _meta,
    _non_root_container_security,
    _pod_security,
    config_map_name,
    labels,
    owner_reference,
    runtime_name,
    selector_labels,
)
from embedfleet.operator.render.model import _model_volumes
from embedfleet.operator.render.revisions import (
    REVISION_COMPONENT,
    default_runs,
    revision_config_map_name,
    revision_labels,
    revision_object_name,
    spec_for,
)
from embedfleet.operator.rollout.revisions import Run

#: spec.runtime.apiKeysSecret's key, mounted read-only (a secret volume); EMBEDFLEET_API_KEYS names the file.
API_KEYS_DIR = "/etc/embedfleet/api-keys"
API_KEYS_FILE = "keys.yaml"
#: Owner and group read (the pod's fsGroup is the group): the runtime reads it, nobody else in the pod.
API_KEYS_MODE = 0o440
#: Seconds preStop waits so endpoints drop the pod before SIGTERM starts the runtime's drain.
PRESTOP_SLEEP_SECONDS = 5
READY_PERIOD_SECONDS = 1  # the kubelet's shortest probe period
NOT_READY_AFTER_SECONDS = 5  # of failed /ready reads in a row before a serving pod leaves its Service
#: Margin on top of preStop + drain so the kubelet never SIGKILLs a pod that is still draining.
GRACE_MARGIN_SECONDS = 10


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
    volumes, mounts, init_containers = _model_volumes(spec, image)
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
        # The kubelet reads /ready every second, so a pod is Ready within a second of being able to answer
        # (at every 5 s, a cold start waited up to 5 s more for its probe). A serving pod turns NotReady
        # after 5 s of failed reads in a row (two reads 5 s apart before: 5 to 10 s), so a moment's
        # overload does not churn the endpoints; one good read brings it back (within 1 s, was up to 5).
        # /ready is an open path answered from memory: a read costs the pod about 0.1 ms.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 600,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": READY_PERIOD_SECONDS,
            "timeoutSeconds": 2,
            "failureThreshold": NOT_READY_AFTER_SECONDS // READY_PERIOD_SECONDS,
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
