"""Checks a spec needs beyond what an OpenAPI schema can say.

The CRD schema rejects wrong types and out-of-range numbers at ``kubectl apply``; what is left are
relations between fields (min > max, a batch smaller than one input), names from outside the schema
(GPU types) and per-scheme shapes of the model source. Each problem is one human sentence naming the
field, because it ends up verbatim in the ``Accepted=False`` condition a user reads in ``kubectl describe``.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity
from pydantic import ValidationError

from embedfleet.operator import platform
from embedfleet.operator.autoscale_schedule import entry_problems
from embedfleet.operator.crd.gpus import KNOWN_GPU_TYPES
from embedfleet.operator.crd.models import (
    EXCLUSIVE_API_KEYS,
    UNSUPPORTED_SOURCE,
    EmbeddingDeploymentSpec,
    ModelCacheSpec,
    ModelSource,
)
from embedfleet.operator.platform import PlatformPolicy

#: Maximum sequence length of models we know, so a too-small batch is caught without downloading anything.
KNOWN_MODEL_MAX_TOKENS: dict[str, int] = {
    "sentence-transformers/all-minilm-l6-v2": 256,
    "sentence-transformers/all-minilm-l12-v2": 256,
    "sentence-transformers/all-mpnet-base-v2": 384,
    "baai/bge-small-en-v1.5": 512,
    "baai/bge-base-en-v1.5": 512,
    "baai/bge-large-en-v1.5": 512,
    "baai/bge-m3": 8192,
    "baai/bge-reranker-v2-m3": 8192,
    "intfloat/e5-small-v2": 512,
    "intfloat/e5-base-v2": 512,
    "intfloat/e5-large-v2": 512,
    "intfloat/multilingual-e5-large": 512,
    "nomic-ai/nomic-embed-text-v1.5": 8192,
    "mixedbread-ai/mxbai-embed-large-v1": 512,
    "qwen/qwen3-embedding-0.6b": 32768,
    "alibaba-nlp/gte-qwen2-1.5b-instruct": 32768,
}

#: Object names are derived from the resource name (``<name>-prepull-<pool>``, Service = DNS-1035 label).
MAX_NAME_LENGTH = 45
#: The runtime's --max-batch-tokens default on CPU (runtime/settings.py; a test keeps the two equal).
RUNTIME_CPU_MAX_BATCH_TOKENS = 16384
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def _field(loc: tuple[Any, ...], root: str) -> str:
    path = root
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def schema_messages(exc: ValidationError, root: str = "spec") -> list[str]:
    """pydantic's errors as ``spec.a.b: what is wrong`` lines."""
    return [f"{_field(err['loc'], root)}: {err['msg']}" for err in exc.errors()]


def hf_repo(source: str) -> str | None:
    """``org/name`` of an hf:// source, lower-cased for table look-ups; None for other schemes."""
    if not source.startswith("hf://"):
        return None
    return source[len("hf://") :].strip("/").lower()


def source_problems(source: str) -> list[str]:
    """Per-scheme shape of spec.model.source; empty when it is well formed."""
    where = "spec.model.source"
    parsed = urllib.parse.urlsplit(source)
    scheme = parsed.scheme
    if scheme == "hf":
        parts = source[len("hf://") :].split("/")
        if not 1 <= len(parts) <= 2 or not all(_HF_PART.match(p) for p in parts):
            return [f"{where}: {source!r} is not hf://<org>/<name> (or hf://<name>)"]
        return []
    if scheme in ("s3", "gs"):
        return [f"{where}: {UNSUPPORTED_SOURCE}"]
    if scheme in ("http", "https"):
        if not parsed.hostname:
            return [f"{where}: {source!r} has no host"]
        try:
            _ = parsed.port
        except ValueError:
            return [f"{where}: {source!r} has an invalid port"]
        return []
    if scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            return [f"{where}: {source!r} must be file:///<absolute path>"]
        return []
    if scheme == "pvc":
        if not _DNS1123.match(parsed.netloc or "") or len(parsed.netloc) > 253:
            return [f"{where}: {parsed.netloc!r} is not a valid PersistentVolumeClaim name in {source!r}"]
        return []
    return [f"{where}: unsupported scheme in {source!r} (hf, http, https, file, pvc)"]


def needs_download(source: str) -> bool:
    """file:// is inside the image and pvc:// is mounted; everything else is fetched and verified."""
    return not source.startswith(("file://", "pvc://"))


def model_max_tokens(model: ModelSource) -> int | None:
    """The model's max sequence length when the spec states it or we know the model."""
    if model.max_input_tokens is not None:
        return model.max_input_tokens
    repo = hf_repo(model.source)
    return KNOWN_MODEL_MAX_TOKENS.get(repo) if repo else None


def _quantity_problems(requests: Mapping[str, Any], limits: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, limit in limits.items():
        if key in requests and parse_quantity(requests[key]) > parse_quantity(limit):
            problems.append(
                f"spec.runtime.resources: request {key}={requests[key]} exceeds its limit {key}={limit}"
            )
    return problems


def name_problems(name: str) -> list[str]:
    if len(name) > MAX_NAME_LENGTH or not _DNS1035.match(name):
        return [
            f"metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
            "(lower-case letters, digits, '-'; starts with a letter): derived object names need room"
        ]
    return []


def validate(spec: EmbeddingDeploymentSpec, name: str | None = None) -> list[str]:
    """Every semantic problem of a schema-valid spec; empty means it can be rendered."""
    problems: list[str] = []
    if name is not None:
        problems += name_problems(name)
    problems += source_problems(spec.model.source)

    auto, runtime, cache = spec.autoscaling, spec.runtime, spec.cache
    if auto.min_replicas > auto.max_replicas:
        problems.append(
            f"spec.autoscaling.minReplicas ({auto.min_replicas}) is greater than "
            f"maxReplicas ({auto.max_replicas})"
        )
    if auto.panic_window_seconds > auto.stable_window_seconds:
        problems.append(
            f"spec.autoscaling.panicWindowSeconds ({auto.panic_window_seconds:g}) must not exceed "
            f"stableWindowSeconds ({auto.stable_window_seconds:g})"
        )
    problems += entry_problems(auto.schedule, auto.max_replicas)
    if not auto.enabled and spec.replicas is None and auto.min_replicas == 0:
        problems.append(
            "spec.replicas: autoscaling is disabled and minReplicas is 0, so nothing would run; "
            "set spec.replicas"
        )

    max_len = model_max_tokens(spec.model)
    needed = runtime.max_input_tokens if runtime.max_input_tokens is not None else max_len
    if max_len is not None and runtime.max_input_tokens is not None and runtime.max_input_tokens > max_len:
        problems.append(
            f"spec.runtime.maxInputTokens ({runtime.max_input_tokens}) exceeds the model's "
            f"maximum length ({max_len})"
        )
    # unset: the runtime's CPU default; on a GPU the runtime sizes it to hold the longest input where memory
    # allows, and refuses to start, saying so, where it does not
    budget = runtime.max_batch_tokens
    if budget is None and runtime.gpu.count == 0:
        budget = RUNTIME_CPU_MAX_BATCH_TOKENS
    if needed is not None and budget is not None and budget < needed:
        set_or_default = "" if runtime.max_batch_tokens is not None else ", the runtime's CPU default"
        problems.append(
            f"spec.runtime.maxBatchTokens ({budget}{set_or_default}) is smaller than the longest input "
            f"({needed} tokens): one full-length input would never fit in a batch"
        )

    if runtime.engines is not None and runtime.engines > 1 and not runtime.fronts:
        problems.append(
            f"spec.runtime.engines ({runtime.engines}) needs split serving: set spec.runtime.fronts to 1 or more "
            "(unset or 0 may mean one process, which has one engine)"
        )

    gpu = runtime.gpu
    if gpu.type is not None and gpu.type not in KNOWN_GPU_TYPES:
        problems.append(
            f"spec.runtime.gpu.type: unknown GPU type {gpu.type!r}; "
            f"known: {', '.join(sorted(KNOWN_GPU_TYPES))}"
        )
    if gpu.type is not None and gpu.count == 0:
        problems.append(f"spec.runtime.gpu.type is {gpu.type!r} but gpu.count is 0")
    if runtime.dtype == "int8" and (gpu.count > 0 or runtime.engine != "torch"):
        problems.append("spec.runtime.dtype: int8 is CPU only (an OpenVINO int8 build, engine torch); on a GPU "
                        "use fp8 or bfloat16")
    if gpu.count == 0:
        if runtime.engine == "trtllm":
            problems.append("spec.runtime.engine: trtllm needs a GPU (set spec.runtime.gpu.count >= 1)")
        if runtime.dtype == "fp8" or runtime.quantization == "fp8":
            problems.append(
                "spec.runtime.dtype/quantization: fp8 needs a GPU (set spec.runtime.gpu.count >= 1)"
            )
    problems += _quantity_problems(runtime.resources.requests, runtime.resources.limits)
    if runtime.api_key_secret is not None and runtime.api_keys_secret is not None:
        problems.append(f"spec.runtime: {EXCLUSIVE_API_KEYS}")

    if spec.model.digest is None and needs_download(spec.model.source):
        problems.append(
            "spec.model.digest is required for hf/http(s) sources: downloaded weights are verified "
            "against it and cached under it"
        )
    if cache.require_cached_node and not cache.pre_pull:
        problems.append(
            "spec.cache.requireCachedNode needs spec.cache.prePull: no node would ever be labelled"
        )
    if cache.pre_pull and not needs_download(spec.model.source):
        problems.append("spec.cache.prePull: file:// and pvc:// models are not downloaded, so not pre-pulled")
    pools = [pool.name for pool in cache.node_pools]
    if len(pools) != len(set(pools)):
        problems.append(f"spec.cache.nodePools: pool names must be unique, got {pools}")

    clusters = [w.cluster for w in spec.placement.weights]
    if len(clusters) != len(set(clusters)):
        problems.append(f"spec.placement.weights: each cluster may appear once, got {clusters}")
    return problems


def check(
    name: str, raw_spec: Mapping[str, Any], policy: PlatformPolicy | None = None
) -> tuple[EmbeddingDeploymentSpec | None, list[str]]:
    """Parse then validate (against the platform's allow-lists too, when given); the spec is returned
    only when there is nothing to complain about."""
    try:
        spec = EmbeddingDeploymentSpec.model_validate(dict(raw_spec))
    except ValidationError as exc:
        return None, schema_messages(exc)
    problems = validate(spec, name)
    if policy is not None:
        problems += platform.deployment_problems(raw_spec, policy)
    return (None if problems else spec), problems


def check_model_cache(
    name: str, raw_spec: Mapping[str, Any], policy: PlatformPolicy | None = None
) -> tuple[ModelCacheSpec | None, list[str]]:
    try:
        spec = ModelCacheSpec.model_validate(dict(raw_spec))
    except ValidationError as exc:
        return None, schema_messages(exc)
    problems = name_problems(name) + source_problems(spec.model.source)
    if policy is not None:
        problems += platform.model_cache_problems(raw_spec, policy)
    if spec.model.digest is None:
        problems.append(
            "spec.model.digest is required: it keys the node cache and is verified after download"
        )
    if not needs_download(spec.model.source):
        problems.append("spec.model.source: file:// and pvc:// models are not downloaded, so not pre-pulled")
    pools = [pool.name for pool in spec.node_pools]
    if len(pools) != len(set(pools)):
        problems.append(f"spec.nodePools: pool names must be unique, got {pools}")
    return (None if problems else spec), problems
