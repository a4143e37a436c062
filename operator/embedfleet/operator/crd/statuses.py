"""The ``status`` of EmbeddingDeployment and ModelCache, as pydantic models: rendered into the CRDs' schema
with the specs (crd/models.py, schema.py), and the shape the operator's status writers keep to
(operator/status.py says which writer owns which field).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from embedfleet.operator.crd.base import CamelModel
from embedfleet.operator.crd.models import REVISION_NAME_PATTERN
from embedfleet.operator.crd.spot import SpotStatus

ConditionType = Literal["Accepted", "CacheReady", "Available", "Scaling", "Degraded", "RolloutBlocked"]


class Condition(CamelModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(default="", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str | None = None
    observed_generation: int | None = None


class ReplicaStatus(CamelModel):
    desired: int = 0
    current: int = 0
    ready: int = 0


class ScaleDecision(CamelModel):
    time: str
    from_replicas: int = Field(ge=0)
    to_replicas: int = Field(ge=0)
    in_flight: float = 0
    mode: str = "stable"
    reason: str = ""


class ClusterRow(CamelModel):
    """One spoke's share of a hub EmbeddingDeployment, as the hub last decided and observed it."""

    name: str
    region: str = ""
    min: int = 0
    desired: int = 0
    max: int = 0
    ready: int | None = None
    inflight: float | None = None
    cache: str | None = Field(default=None, description="The spoke's CacheReady reason, or cached/total nodes.")
    last_seen: str | None = None
    reasons: list[str] = Field(default_factory=list)
    revision: str | None = Field(default=None, description="The revision the spoke reports current.")


RevisionState = Literal["Serving", "Candidate", "SideBySide", "Draining", "Blocked", "Retired"]
RolloutPhase = Literal["Idle", "Gating", "Blocked", "SideBySide", "Promoting", "Waves", "RolledBack", "Done"]


class GateStatus(CamelModel):
    """The drift gate's measurement of a revision against the one it would replace."""

    passed: bool
    min_cosine: float | None = None
    mean_cosine: float | None = None
    order_kept: bool | None = None
    message: str = Field(default="", max_length=4096)


class RevisionStatus(CamelModel):
    """One revision: its identity, fingerprint, vector space and where it stands."""

    name: str = Field(pattern=REVISION_NAME_PATTERN)
    hash: str = Field(max_length=64, description="Hash of the identity fields (embedfleet.compat.identity).")
    source: str = Field(max_length=1024)
    model_revision: str | None = Field(default=None, max_length=255)
    digest: str | None = None
    dtype: str = "float32"
    quantization: str = "none"
    engine: str = "torch"
    fingerprint: str | None = Field(default=None, max_length=80, description="sha256 of its probe outputs.")
    vector_space: str = Field(max_length=63, description="Revisions in one vector space are interchangeable.")
    state: RevisionState
    served_names: list[str] = Field(default_factory=list)
    created_at: str | None = None
    gate: GateStatus | None = None


class RolloutStatus(CamelModel):
    phase: RolloutPhase = "Idle"
    revision: str | None = Field(default=None, description="The revision being rolled out.")
    wave: int | None = Field(default=None, description="Hub: index of the wave in progress (0-based).")
    waves_total: int | None = None
    wave_started_at: str | None = None
    started_at: str | None = None
    message: str = Field(default="", max_length=4096)


class ProbeDriftStatus(CamelModel):
    """What the runtimes' periodic probe checks show (embedfleet_probe_cosine), as the operator last scraped."""

    drifted: bool
    min_cosine: float | None = None
    pods: list[str] = Field(default_factory=list, description="Pods whose probe is out of tolerance.")
    message: str = Field(default="", max_length=4096)
    checked_at: str | None = None


class EmbeddingDeploymentStatus(CamelModel):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: ReplicaStatus = Field(default_factory=ReplicaStatus)
    in_flight: float | None = None
    cached_nodes: int | None = None
    total_nodes: int | None = None
    selector: str | None = Field(default=None, description="Pod label selector (scale subresource).")
    last_scale_decision: ScaleDecision | None = None
    clusters: list[ClusterRow] | None = Field(
        default=None, description="Hub only: per-spoke shares and what each spoke reports."
    )
    target_replicas: int | None = Field(default=None, description="Hub only: the fleet-wide replica target.")
    revisions: list[RevisionStatus] | None = Field(
        default=None, description="Every revision still live or last seen, oldest first (docs/rollouts.md)."
    )
    current_revision: str | None = Field(default=None, description="The revision answering the bare model name.")
    query_vector_space: str | None = Field(
        default=None, description="The vector space the bare model name resolves to (gateways pin to it)."
    )
    rollout: RolloutStatus | None = None
    probe_drift: ProbeDriftStatus | None = None
    image: str | None = Field(
        default=None, description="The image the runtime Deployment runs (spec.runtime.image or the platform's)."
    )
    spot: SpotStatus | None = None


class NodeCacheState(CamelModel):
    name: str
    ready: bool


class ModelCacheStatus(CamelModel):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    cached_nodes: int | None = None
    total_nodes: int | None = None
    nodes: list[NodeCacheState] = Field(default_factory=list)
