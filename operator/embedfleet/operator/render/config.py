"""The runtime's ConfigMap: its configuration contract (``EMBEDFLEET_*`` variables) for one revision.
Separate from the Deployment because the Deployment only names it (``envFrom``) and carries its content
hash, so a changed setting rolls the pods without the pod template knowing any setting.
"""

from __future__ import annotations

from collections.abc import Mapping

from embedfleet.operator.cache.engines import ENGINES_MOUNT
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.crd.prepull import shares_engine_builds
from embedfleet.operator.render.common import Manifest, _meta, config_map_name, labels, owner_reference
from embedfleet.operator.render.model import downloaded, model_dir
from embedfleet.operator.render.revisions import (
    REVISION_COMPONENT,
    default_runs,
    revision_config_map_name,
    spec_for,
)
from embedfleet.operator.rollout.revisions import Run


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
        "EMBEDFLEET_MAX_CLIENT_BATCH_SIZE": str(rt.max_client_batch_size),
        "EMBEDFLEET_MAX_CONCURRENT_REQUESTS": str(rt.max_concurrent_requests),
        "EMBEDFLEET_DRAIN_TIMEOUT": str(rt.drain_timeout_seconds),
        "EMBEDFLEET_REVISION": run.revision,
        "EMBEDFLEET_VECTOR_SPACE": run.vector_space,
        "EMBEDFLEET_PROBE_INTERVAL": f"{spec.rollout.probe_interval_seconds:g}",
        "EMBEDFLEET_PROBE_MIN_COSINE": f"{spec.rollout.min_cosine:g}",
    }
    optional = {
        # unset: the runtime's own (its CPU defaults; on a GPU, sized at start-up: docs/gpu.md)
        "EMBEDFLEET_MAX_BATCH_TOKENS": rt.max_batch_tokens,
        "EMBEDFLEET_MAX_BATCH_REQUESTS": rt.max_batch_requests,
        "EMBEDFLEET_MAX_INPUT_TOKENS": rt.max_input_tokens,
        "EMBEDFLEET_PAYLOAD_LIMIT": rt.payload_limit,
        "EMBEDFLEET_TOKENIZER_WORKERS": rt.tokenizer_workers,
        "EMBEDFLEET_FRONTS": rt.fronts,
        "EMBEDFLEET_ENGINES": rt.engines,
        "EMBEDFLEET_STANDBY": None if rt.standby is None else str(rt.standby).lower(),
        # the same bounds the gateway sheds by for this deployment (gateway/bounds.py)
        "EMBEDFLEET_MAX_QUEUE_SECONDS": rt.max_queue_seconds,
        "EMBEDFLEET_MAX_QUEUE_SECONDS_BULK": rt.max_queue_seconds_bulk,
    }
    env.update({key: str(value) for key, value in optional.items() if value is not None})
    if downloaded(spec.model) and spec.model.digest is not None:
        env["EMBEDFLEET_MODEL_DIGEST"] = spec.model.digest  # the runtime verifies before loading
    if shares_engine_builds(spec):
        env["EMBEDFLEET_ENGINE_CACHE_DIR"] = ENGINES_MOUNT  # the node's engines folder (render/model.py)
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
