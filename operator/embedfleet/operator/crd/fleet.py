"""FleetCluster and PlacementPolicy: the hub's cluster-scoped resources, defined once as pydantic models.

FleetCluster is the hub's inventory entry for one spoke: where it is (provider, region, zones, residency
labels), what it offers (CPU replica slots, GPU types with counts and hourly prices), how the hub reaches
it (a kubeconfig in a Secret on the hub) and how long its heartbeat lease may lapse. PlacementPolicy is
what a platform team owns: placement constraints and defaults for every EmbeddingDeployment in the
namespaces its selector matches.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from embedfleet.operator.crd.models import (
    DNS_LABEL_PATTERN,
    CamelModel,
    ClusterLimit,
    ClusterToleration,
    ClusterWeight,
    PlacementMode,
)
from embedfleet.operator.crd.statuses import Condition
from embedfleet.operator.crd.structural import condition_column, crd_document, root_schema

FLEET_CLUSTER_KIND = "FleetCluster"
FLEET_CLUSTER_PLURAL = "fleetclusters"
PLACEMENT_POLICY_KIND = "PlacementPolicy"
PLACEMENT_POLICY_PLURAL = "placementpolicies"


class GPUCapacitySpec(CamelModel):
    type: str = Field(min_length=1, max_length=63, description="GPU type, e.g. nvidia-h100 (crd/gpus.py).")
    count: int = Field(ge=0, le=1_000_000)
    hourly_price: float = Field(default=0.0, ge=0, description="Price per GPU hour; cheaper scores higher.")
    spot_hourly_price: float | None = Field(
        default=None, ge=0,
        description="Price per GPU hour on this cluster's spot nodes of this type (docs/spot.md); a deployment "
        "with spec.spot is costed at its mix of spot and on-demand. Unset: no spot pool.",
    )


class CapacitySpec(CamelModel):
    cpu_replicas: int = Field(default=0, ge=0, le=1_000_000, description="CPU-only runtime replicas it can run.")
    cpu_hourly_price: float = Field(default=0.0, ge=0)
    cpu_spot_hourly_price: float | None = Field(
        default=None, ge=0, description="Price of a CPU replica slot on spot nodes. Unset: no spot pool.")
    gpus: list[GPUCapacitySpec] = Field(default_factory=list)


class SecretReference(CamelModel):
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    namespace: str = Field(default="embedfleet-system", pattern=DNS_LABEL_PATTERN, max_length=63)
    key: str = Field(default="kubeconfig", min_length=1, max_length=253)


class ConnectionSpec(CamelModel):
    """The hub pulls: it reaches each spoke's API server with this kubeconfig (see docs/hub.md for why)."""

    kubeconfig_secret: SecretReference
    namespace: str = Field(
        default="embedfleet-system",
        pattern=DNS_LABEL_PATTERN,
        max_length=63,
        description="Namespace on the spoke holding the spoke operator's heartbeat Lease.",
    )


class LeaseSpec(CamelModel):
    duration_seconds: float = Field(
        default=30, gt=0, le=3600, description="How long one heartbeat is valid (the spoke renews well within)."
    )
    grace_seconds: float = Field(
        default=60, ge=0, le=86400, description="Further time an expired lease is tolerated before failover."
    )


class TaintSpec(CamelModel):
    key: str = Field(min_length=1, max_length=253)
    value: str = Field(default="", max_length=63)
    effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"


class FleetClusterSpec(CamelModel):
    provider: str = Field(default="", max_length=63, description="aws, gcp, azure, onprem, ...")
    region: str = Field(min_length=1, max_length=63)
    zones: list[str] = Field(default_factory=list)
    residency: list[str] = Field(default_factory=list, description="Data-residency labels, e.g. eu-gdpr.")
    capacity: CapacitySpec = Field(default_factory=CapacitySpec)
    connection: ConnectionSpec
    lease: LeaseSpec = Field(default_factory=LeaseSpec)
    taints: list[TaintSpec] = Field(default_factory=list)
    gateway_url: str | None = Field(
        default=None, max_length=2048, pattern=r"^https?://[^\s/?#]+/?$",
        description="This cluster's gateway (embedfleet gateway) as other clusters' gateways reach it: requests "
        "spill here when the placement policy allows (ActiveActive, RegionLocked within its regions, ActivePassive to "
        "the standby). Unset: nothing spills to this cluster.")


class ClusterGatewayStatus(CamelModel):
    """This cluster's gateway as other regions see it: where it is, and its load as the spoke's heartbeat
    last reported it (its gateway pods' GET /gateway/load, summed). The hub copies every change it reads, so
    the numbers are current while Available=True; after that they are the last reported."""

    url: str | None = Field(default=None, description="spec.gatewayUrl: where other regions' gateways spill to.")
    gateways: int | None = Field(default=None, ge=0, description="Gateway pods that answered the spoke.")
    unanswered: int | None = Field(
        default=None, ge=0, description="Gateway pods that did not answer within the heartbeat's time-out.")
    held: int | None = Field(default=None, ge=0, description="Requests held while their deployment has no ready "
                             "replica, summed over the gateways.")
    in_flight: int | None = Field(default=None, ge=0, description="Requests the gateways are handling, held included.")
    cold_deployments: int | None = Field(
        default=None, ge=0, description="Deployments with held requests and no ready replica (cold starts).")


class FleetClusterStatus(CamelModel):
    conditions: list[Condition] = Field(default_factory=list)
    last_heartbeat: str | None = Field(default=None, description="Hub time the spoke's lease was last seen renewed.")
    renew_time: str | None = Field(default=None, description="The lease's renewTime as the spoke wrote it.")
    available_since: str | None = None
    allocatable: CapacitySpec | None = None
    cached_models: list[str] = Field(default_factory=list, description="Digest keys cached on the spoke's nodes.")
    spoke_version: str | None = None
    gateway: ClusterGatewayStatus | None = Field(
        default=None, description="Empty: no spec.gatewayUrl and no load reported (a spoke older than this "
        "field, or one that cannot list its gateway pods: then Degraded says so). gateways 0: no gateway pod runs.")


class NamespaceSelector(CamelModel):
    match_labels: dict[str, str] = Field(default_factory=dict, description="Empty: every namespace.")


class PlacementPolicySpec(CamelModel):
    """Constraints and defaults; an EmbeddingDeployment's inline placement may narrow them, never widen."""

    namespace_selector: NamespaceSelector = Field(default_factory=NamespaceSelector)
    priority: int = Field(default=0, ge=-1000, le=1000, description="Highest matching priority applies.")
    mode: PlacementMode | None = None
    regions: list[str] = Field(default_factory=list)
    residency: list[str] = Field(default_factory=list)
    min_regions: int | None = Field(default=None, ge=1, le=64)
    primary_regions: list[str] = Field(default_factory=list)
    gpu_types: list[str] = Field(default_factory=list)
    division: Literal["Duplicated", "Divided"] | None = None
    weights: list[ClusterWeight] = Field(default_factory=list)
    cluster_limits: list[ClusterLimit] = Field(default_factory=list)
    max_replicas_per_cluster: int | None = Field(default=None, ge=1, le=10000)
    tolerations: list[ClusterToleration] = Field(default_factory=list)
    propagate_secrets: bool = Field(
        default=False,
        description="Copy the API-key Secret a governed deployment references (spec.runtime.apiKeySecret / "
        "apiKeysSecret) to each spoke it is placed on (the spoke's chart must grant it: "
        "hubAccess.propagateSecrets). Off: the Secret must exist on the spoke, else Placed=False says so.")


class PolicyConflict(CamelModel):
    deployment: str = Field(description="namespace/name")
    message: str


class PlacementPolicyStatus(CamelModel):
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    matched_deployments: int | None = Field(default=None, description="Deployments this policy governs.")
    deployments: list[str] = Field(default_factory=list, description="The first 50 it governs (namespace/name).")
    conflicts: list[PolicyConflict] = Field(
        default_factory=list, description="Governed deployments whose inline placement contradicts it (first 50).")


def fleet_crds() -> list[dict[str, Any]]:
    return [
        crd_document(
            kind=FLEET_CLUSTER_KIND,
            plural=FLEET_CLUSTER_PLURAL,
            singular="fleetcluster",
            short_names=("fc",),
            scope="Cluster",
            schema=root_schema(FleetClusterSpec, FleetClusterStatus),
            columns=[
                {"name": "Region", "type": "string", "jsonPath": ".spec.region"},
                {"name": "Provider", "type": "string", "jsonPath": ".spec.provider"},
                condition_column("Joined", 0),
                condition_column("Available", 0),
                condition_column("CredentialsValid", 1),
                {"name": "Held", "type": "integer", "jsonPath": ".status.gateway.held", "priority": 1},
                {"name": "In-Flight", "type": "integer", "jsonPath": ".status.gateway.inFlight", "priority": 1},
                {"name": "Cold", "type": "integer", "jsonPath": ".status.gateway.coldDeployments", "priority": 1},
                {"name": "Heartbeat", "type": "date", "jsonPath": ".status.lastHeartbeat"},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ],
            subresources={"status": {}},
        ),
        crd_document(
            kind=PLACEMENT_POLICY_KIND,
            plural=PLACEMENT_POLICY_PLURAL,
            singular="placementpolicy",
            short_names=("pp",),
            scope="Cluster",
            schema=root_schema(PlacementPolicySpec, PlacementPolicyStatus),
            columns=[
                {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority"},
                {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
                {"name": "Deployments", "type": "integer", "jsonPath": ".status.matchedDeployments"},
                condition_column("Conflicts", 1),
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ],
            subresources={"status": {}},
        ),
    ]


__all__ = ["FleetClusterSpec", "FleetClusterStatus", "PlacementPolicySpec", "PlacementPolicyStatus", "fleet_crds"]
