"""EmbeddingDeployment and ModelCache specs, defined once as pydantic models (their status: statuses.py).

These models are the single source of truth for three things: the CRD's openAPIV3Schema (rendered by
`schema.py` into ``crds/*.yaml``), the operator's parsing of ``spec`` (a spec that reaches a handler is
parsed here, so an emulator or an old API server without the schema still gets the same checks), and,
with statuses.py, the shape of ``status``. Python attributes are snake_case; the wire format is
camelCase, like every Kubernetes API.

Defaults here become schema defaults, so the API server fills them in and ``kubectl get -o yaml`` shows
what the operator will use. Rate-limit fields deliberately have no schema default: naming either one
replaces both defaults (HPA v2 semantics), which defaulting on the server would silently defeat. Nor
has ``runtime.image``: a default stored in each object would pin it, where unset follows the platform's
default image (``status.image`` shows the one in use).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema

from embedfleet.operator.crd.base import CamelModel
from embedfleet.operator.crd.schedule import Schedule
from embedfleet.operator.crd.spot import SpotSpec

#: The schema checks the scheme only; embedfleet.operator.validate checks each scheme's shape with a message.
MODEL_SOURCE_PATTERN = r"^(hf|s3|gs|https?|file|pvc)://\S+$"
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
#: One sentence, shared by the CRD's CEL rule and the operator's validation.
UNSUPPORTED_SOURCE = (
    "s3:// and gs:// sources are not supported by the node cache puller: publish the weights over https "
    "(a presigned/signed URL to a .tar archive, or a directory with a SHA256SUMS manifest from "
    "`embedfleet cache digest --write-manifest`), or mount them with pvc://"
)
#: One sentence, shared by the CRD's CEL rule on spec.runtime and the operator's validation.
EXCLUSIVE_API_KEYS = (
    "apiKeySecret and apiKeysSecret are mutually exclusive: use apiKeysSecret alone for several tenants "
    "(a single key is then one more tenant in its keys file)"
)
#: Kubernetes resource quantity (e.g. 500m, 2Gi, 1.5).
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

Engine = Literal["torch", "trtllm"]
DType = Literal["float32", "bfloat16", "float16", "fp8", "int8"]
Quantization = Literal["none", "fp8"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
_QUANTITY = re.compile(QUANTITY_PATTERN)


def _quantity(value: int | str) -> str:
    """Kubernetes accepts 2 and "2" alike; keep the string form so rendering has one type."""
    text = str(value)
    if isinstance(value, bool) or not _QUANTITY.match(text):
        raise ValueError(f"not a Kubernetes quantity: {value!r} (e.g. 500m, 2Gi, 1)")
    return text


Quantity = Annotated[
    int | str,
    AfterValidator(_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY_PATTERN}],
        }
    ),
]


# ---------------------------------------------------------------- model


class ModelSource(CamelModel):
    """Where the weights come from and which exact bytes are meant."""

    source: str = Field(
        pattern=MODEL_SOURCE_PATTERN,
        max_length=1024,
        description="hf://org/name, http(s)://host/path, file:///abs/path or pvc://claim/path "
        "(s3:// and gs:// are refused: publish over https with a SHA256SUMS manifest).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!self.startsWith('s3://') && !self.startsWith('gs://')", "message": UNSUPPORTED_SOURCE}
            ]
        },
    )
    revision: str | None = Field(
        default=None, max_length=255, description="Branch, tag or commit (hf://); ignored by other schemes."
    )
    digest: str | None = Field(
        default=None,
        pattern=DIGEST_PATTERN,
        description="sha256 of the weights archive; required for pre-pull, it keys the node-local cache.",
    )
    served_model_name: str | None = Field(
        default=None,
        max_length=253,
        description="Name reported by /v1/models; defaults to the resource name.",
    )
    max_input_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description="The model's maximum sequence length, when known; checked against maxBatchTokens.",
    )


# ---------------------------------------------------------------- runtime


class ResourceRequirements(CamelModel):
    requests: dict[str, Quantity] = Field(
        default_factory=lambda: {"cpu": "1", "memory": "2Gi"},
        json_schema_extra={"default": {"cpu": "1", "memory": "2Gi"}},
    )
    limits: dict[str, Quantity] = Field(
        default_factory=lambda: {"memory": "4Gi"}, json_schema_extra={"default": {"memory": "4Gi"}}
    )


class GPUSpec(CamelModel):
    count: int = Field(default=0, ge=0, le=16, description="nvidia.com/gpu per replica; 0 runs on CPU.")
    type: str | None = Field(
        default=None,
        max_length=63,
        description="GPU model (e.g. nvidia-h100, nvidia-l4); pins pods to nodes with that GPU. "
        "See embedfleet.operator.crd.gpus for the known types.",
    )


class SecretKeyRef(CamelModel):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    key: str = Field(min_length=1, max_length=253)


class Toleration(CamelModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class RuntimeSpec(CamelModel):
    """The data plane pods: image, engine and the limits the batcher enforces."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.apiKeySecret) || !has(self.apiKeysSecret)", "message": EXCLUSIVE_API_KEYS}
            ]
        }
    )

    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="The runtime image. Unset: the platform's default (the chart's runtimeImage values, "
        "else the runtime release of the operator's own version), so the pods follow the platform's "
        "upgrades; set it to pin an image.",
    )
    image_pull_policy: PullPolicy = "IfNotPresent"
    engine: Engine = "torch"
    dtype: DType = Field(default="float32", description="int8: CPU only, an OpenVINO int8 build kept only if "
                         "every judged vector keeps cosine >= the runtime's --int8-min-cosine (0.985) with its margin "
                         "against float32 (docs/runtime.md).")
    quantization: Quantization = Field(default="none", description="fp8 runs the engine in FP8 (GPU only).")
    max_batch_requests: int | None = Field(
        default=None, ge=1, le=4096,
        description="Inputs per engine batch (the runtime's --max-batch-requests). Unset: the runtime's own, 32 "
        "on CPU, sized for the GPU at start-up on GPUs (up to 1024). While spec.autoscaling.inFlightPerReplica is "
        "unset, a value other than 32 here is also the autoscaler's in-flight target per replica (deprecated).",
    )
    max_batch_tokens: int | None = Field(
        default=None, ge=1, le=4_194_304,
        description="Tokens per engine batch (the runtime's --max-batch-tokens). Unset: the runtime's own, 16384 "
        "on CPU, sized from the GPU's free memory at start-up on GPUs (up to 65536).")
    max_client_batch_size: int = Field(default=2048, ge=1, le=1_000_000)
    max_concurrent_requests: int = Field(default=512, ge=1, le=1_000_000)
    max_queue_seconds: float | None = Field(
        default=None, gt=0, le=3600,
        description="Refuse (429 with Retry-After) a query expected to wait longer than this many seconds: "
        "the runtime's --max-queue-seconds, and the gateway's shed bound for this deployment (it answers 429 "
        "when every replica is over it; spills first where the placement allows). Unset: the runtime's "
        "default (5) and the gateway's --max-queue-seconds.",
    )
    max_queue_seconds_bulk: float | None = Field(
        default=None, gt=0, le=3600,
        description="The same bound for bulk requests (X-Priority: bulk, or more inputs than the runtime's "
        "--urgent-max-inputs). Unset: the runtime's default (30) and the gateway's --max-queue-seconds-bulk.",
    )
    max_input_tokens: int | None = Field(default=None, ge=1, le=1_048_576)
    payload_limit: int | None = Field(default=None, ge=1024, description="Request body limit in bytes.")
    tokenizer_workers: int | None = Field(default=None, ge=1, le=256)
    fronts: int | None = Field(
        default=None, ge=0, le=64,
        description="Front processes (the runtime's --fronts): HTTP, validation, tokenization and encoding run "
        "in this many processes beside one engine process that batches and runs the model (docs/runtime.md, "
        "split serving). 0: one process. Unset: the runtime chooses (--fronts auto): one process on a CPU; "
        "on a GPU from 4 cores (the pod's CPU limit counts) one front per core but two, at most 8.")
    engines: int | None = Field(
        default=None, ge=1, le=8,
        description="Engine processes per pod (the runtime's --engines), each with its own copy of the model on "
        "the same device and its own batches: for a small model that one engine cannot keep a GPU busy with "
        "(docs/runtime.md, split serving). Needs fronts of at least 1. A tenant with a quota is kept on one "
        "engine, so its quota stays one per pod. Unset: one.")
    standby: bool | None = Field(
        default=None,
        description="The runtime's --standby: a parent process imports torch and the web stack once and holds "
        "the listening socket; a server that dies of a signal (a crash, kill -9; an OOM kill where it takes "
        "the server alone) is replaced from it within the model's load, with no container restart and no "
        "connection refused. Costs the parent's memory (docs/runtime.md, Standby). With fronts unset it "
        "means one process; with fronts set it is not used (their supervisor already replaces its engine).")
    drain_timeout_seconds: int = Field(
        default=30, ge=1, le=3600, description="SIGTERM drain; the pod grace period is longer than this."
    )
    port: int = Field(default=8080, ge=1024, le=65535)
    api_key_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the API key (EMBEDFLEET_API_KEY): one tenant. Not with apiKeysSecret.",
    )
    api_keys_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the tenants keys file (EMBEDFLEET_API_KEYS): tenants with keys, "
        "priority, tokens_per_minute (per replica) and models. Mounted read-only and read by the runtime "
        "at start-up: a change to the Secret takes effect on the next rollout (pods restart). "
        "Not with apiKeySecret.",
    )
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    gpu: GPUSpec = Field(default_factory=GPUSpec)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


# ---------------------------------------------------------------- autoscaling


class ScaleUpRules(CamelModel):
    """HPA v2 behaviour for growing. With neither rate field set: 100% or 4 pods per period, whichever
    is more."""

    stabilization_window_seconds: float = Field(default=0, ge=0, le=3600)
    max_percent_per_period: float | None = Field(default=None, gt=0, le=10000)
    max_pods_per_period: int | None = Field(default=None, ge=1, le=10000)
    period_seconds: float = Field(default=15, gt=0, le=1800)


class ScaleDownRules(CamelModel):
    """HPA v2 behaviour for shrinking. With neither rate field set: 100% per period."""

    stabilization_window_seconds: float = Field(default=300, ge=0, le=3600)
    max_percent_per_period: float | None = Field(default=None, gt=0, le=100)
    max_pods_per_period: int | None = Field(default=None, ge=1, le=10000)
    period_seconds: float = Field(default=15, gt=0, le=1800)


class AutoscalingSpec(CamelModel):
    """Knobs of the in-flight autoscaler (embedfleet.operator.autoscale.from_spec reads these keys).

    Target per replica = inFlightPerReplica * targetUtilization in-flight requests.
    """

    enabled: bool = Field(default=True, description="When false, replicas = spec.replicas or minReplicas.")
    in_flight_per_replica: int | None = Field(
        default=None, ge=1, le=4096,
        description="In-flight requests one replica carries at full use; the target per replica is this "
        "x targetUtilization. Unset: spec.runtime.maxBatchRequests when that is not 32 (deprecated), else 32.",
    )
    min_replicas: int = Field(default=1, ge=0, le=10000)
    max_replicas: int = Field(default=10, ge=1, le=10000)
    target_utilization: float = Field(default=0.7, gt=0, le=1)
    stable_window_seconds: float = Field(default=60, gt=0, le=3600)
    panic_window_seconds: float = Field(default=6, gt=0, le=3600)
    panic_threshold: float = Field(default=2.0, ge=1, le=100)
    scale_up: ScaleUpRules = Field(default_factory=ScaleUpRules)
    scale_down: ScaleDownRules = Field(default_factory=ScaleDownRules)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    scale_to_zero: bool = False
    scale_to_zero_grace_seconds: float = Field(default=30, ge=0, le=86400)
    schedule: Schedule = Field(default_factory=list)
    interval_seconds: float = Field(default=5, ge=0.5, le=300, description="Seconds between decisions.")
    prometheus_url: str | None = Field(
        default=None,
        pattern=r"^https?://\S+$",
        description="Prometheus base URL; when unset the operator scrapes the pods' /metrics directly.",
    )
    query: str | None = Field(
        default=None,
        max_length=4096,
        description="PromQL returning total in-flight requests; default sums embedfleet_requests_in_flight.",
    )


# ---------------------------------------------------------------- cache & placement


class CacheStorage(CamelModel):
    host_path: str | None = Field(
        default=None,
        pattern=r"^/\S*$",
        description="Deprecated: the node cache root is the platform's (chart value platform.cacheRoot); "
        "only that value is accepted here.",
    )
    size_limit: Quantity | None = Field(
        default=None, description="Size limit of the pod-local copy when the node cache does not hold it."
    )


class NodePool(CamelModel):
    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=40)
    node_selector: dict[str, str] = Field(default_factory=dict)


class CacheSpec(CamelModel):
    """Node-local weight cache: pre-pull per node pool, then prefer (or require) nodes that hold it."""

    pre_pull: bool = False
    node_selector: dict[str, str] = Field(default_factory=dict, description="The default node pool.")
    node_pools: list[NodePool] = Field(
        default_factory=list,
        description="One pre-pull DaemonSet per pool; empty means one pool (nodeSelector).",
    )
    storage: CacheStorage = Field(default_factory=CacheStorage)
    require_cached_node: bool = Field(
        default=False, description="Require (not just prefer) nodes labelled as holding the weights."
    )


class ClusterWeight(CamelModel):
    cluster: str = Field(min_length=1, max_length=253)
    weight: int = Field(ge=0, le=1000)


class ClusterLimit(CamelModel):
    cluster: str = Field(min_length=1, max_length=253)
    min_replicas: int = Field(default=0, ge=0, le=10000)
    max_replicas: int | None = Field(default=None, ge=0, le=10000)


class ClusterToleration(CamelModel):
    """Tolerates a FleetCluster taint (same matching rules as a pod toleration)."""

    key: str | None = Field(default=None, max_length=253)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str = Field(default="", max_length=63)
    effect: Literal["NoSchedule", "NoExecute"] | None = None


PlacementMode = Literal["ActiveActive", "RegionLocked", "ActivePassive"]


class PlacementSpec(CamelModel):
    """Multi-cluster placement, used by the hub's scheduler (embedfleet.operator.scheduling); a standalone or
    spoke operator ignores it. Semantics in docs/hub.md."""

    mode: PlacementMode | None = Field(
        default=None,
        description="RegionLocked: only `regions`/`residency`, even during failover. ActiveActive: spread "
        "over at least `minRegions` regions. ActivePassive: `primaryRegions` first, one standby region on "
        "loss. Unset: the PlacementPolicy's mode, else ActiveActive.",
    )
    regions: list[str] = Field(default_factory=list, description="Allowed regions (empty: any).")
    policy: Literal["Duplicated", "Divided"] | None = Field(
        default=None,
        description="Duplicated: every chosen cluster runs the whole replica count. Divided: the count is "
        "split by weight. Unset: the PlacementPolicy's division, else Divided.",
    )
    weights: list[ClusterWeight] = Field(
        default_factory=list, description="Static weights per cluster; empty: even. Unlisted clusters get 0."
    )
    residency: list[str] = Field(
        default_factory=list, description="Data-residency labels a cluster must carry."
    )
    min_regions: int | None = Field(default=None, ge=1, le=64, description="ActiveActive: regions to spread over.")
    primary_regions: list[str] = Field(default_factory=list, description="ActivePassive: the active regions.")
    gpu_types: list[str] = Field(
        default_factory=list, description="Acceptable GPU types in preference order; default runtime.gpu.type."
    )
    cluster_limits: list[ClusterLimit] = Field(default_factory=list, description="Per-cluster min/max replicas.")
    max_replicas_per_cluster: int | None = Field(default=None, ge=1, le=10000)
    max_clusters: int | None = Field(default=None, ge=1, le=1000, description="Use at most this many clusters.")
    tolerations: list[ClusterToleration] = Field(default_factory=list, description="FleetCluster taints tolerated.")
    spill_after_seconds: float | None = Field(
        default=None, ge=0, le=3600,
        description="A gateway sends a request to another region the policy allows when the expected wait "
        "here is longer than this many seconds: a cold start with no ready replica, or a queue with every "
        "replica over it. Unset: the gateway's --spill-after (2).",
    )


# ---------------------------------------------------------------- rollouts (docs/rollouts.md)


Compatibility = Literal["compatible", "breaking"]
REVISION_NAME_PATTERN = r"^r[1-9][0-9]{0,8}$"


class RolloutWave(CamelModel):
    """One step of a hub rollout: the clusters it moves and how long they must stay healthy."""

    name: str | None = Field(default=None, max_length=63)
    regions: list[str] = Field(default_factory=list, description="FleetCluster regions in this wave.")
    clusters: list[str] = Field(default_factory=list, description="FleetCluster names in this wave.")
    cluster_selector: dict[str, str] = Field(
        default_factory=dict, description="FleetCluster labels; a cluster matching any of the three is in the wave."
    )
    max_failures: int = Field(default=0, ge=0, le=10000, description="Clusters of the wave that may fail it.")
    soak_seconds: float = Field(
        default=60, ge=0, le=86400, description="How long the wave must stay healthy before the next starts."
    )


class RolloutSpec(CamelModel):
    """How a change of revision (model, digest, dtype, quantization or engine) reaches traffic."""

    min_cosine: float = Field(
        default=0.999,
        gt=0,
        le=1,
        description="Drift gate of a compatible change: every probe text's cosine between the old and the new "
        "revision must reach this (and the probe's similarity order must hold).",
    )
    query_revision: str | None = Field(
        default=None,
        pattern=REVISION_NAME_PATTERN,
        description="Breaking changes: the revision (status.revisions[].name) that answers the bare model name. "
        "Unset: the older revision keeps it while the new one serves <name>@rN; set it once the re-index is done.",
    )
    gate_timeout_seconds: float = Field(
        default=600, ge=10, le=86400, description="A candidate not probed within this is RolloutBlocked."
    )
    max_error_rate: float = Field(
        default=0.05, ge=0, le=1, description="Hub waves: a cluster answering more 5xx than this fails its wave."
    )
    probe_interval_seconds: float = Field(
        default=300, ge=0, le=86400, description="How often each runtime re-checks its probe for drift (0: never)."
    )
    waves: list[RolloutWave] = Field(
        default_factory=list,
        description="Hub only: clusters in order; clusters in no wave form a last wave. Empty: all at once.",
    )


class MonitoringSpec(CamelModel):
    service_monitor: bool = Field(
        default=False, description="Also create a ServiceMonitor (only where its CRD is installed)."
    )
    scrape_interval: str = Field(default="15s", pattern=r"^[0-9]+(ms|s|m)$")


class EmbeddingDeploymentSpec(CamelModel):
    model: ModelSource
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=10000,
        description="Replica count when autoscaling is disabled (scale subresource).",
    )
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    spot: SpotSpec | None = Field(default=None, description="Spot capacity with on-demand fallback (docs/spot.md).")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    compatibility: Compatibility = Field(
        default="compatible",
        description="compatible: a new revision must pass the drift gate (spec.rollout.minCosine) and then "
        "replaces the old one under the same name. breaking: a re-index is planned; the new revision is served "
        "side by side as <name>@rN until spec.rollout.queryRevision names it.",
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)


class ModelCacheSpec(CamelModel):
    """Weights to keep on the nodes of some pools, independent of any deployment."""

    model: ModelSource
    node_pools: list[NodePool] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)
    storage: CacheStorage = Field(default_factory=CacheStorage)
