"""The scheduler's inputs and outputs: small frozen dataclasses, independent of the CRD models.

The hub converts FleetCluster / PlacementPolicy / EmbeddingDeployment objects into these (see
embedfleet.operator.hub.convert), so the scheduler can be tested, benchmarked and reasoned about without
pydantic, kopf or an API server, and so its inputs are hashable (filter results are cached per intent).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["ActiveActive", "RegionLocked", "ActivePassive"]
Division = Literal["Duplicated", "Divided"]
TaintEffect = Literal["NoSchedule", "NoExecute"]
#: Capacity key of a CPU-only replica (GPU replicas use the GPU type name).
CPU = "cpu"


@dataclass(frozen=True, slots=True)
class GPUCapacity:
    type: str
    count: int
    hourly_price: float = 0.0
    #: On the cluster's spot nodes of this type (None: it has none).
    spot_hourly_price: float | None = None


@dataclass(frozen=True, slots=True)
class Taint:
    """NoSchedule: keep what runs there, place nothing new. NoExecute: move everything away."""

    key: str
    value: str = ""
    effect: TaintEffect = "NoSchedule"


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str = ""
    effect: TaintEffect | None = None

    def tolerates(self, taint: Taint) -> bool:
        if self.effect is not None and self.effect != taint.effect:
            return False
        if self.key is None:
            return self.operator == "Exists"
        if self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


@dataclass(frozen=True, slots=True)
class Cluster:
    """One spoke as the hub sees it. ``available`` already includes the lease grace period."""

    name: str
    region: str
    provider: str = ""
    zones: tuple[str, ...] = ()
    residency: frozenset[str] = frozenset()
    gpus: tuple[GPUCapacity, ...] = ()
    cpu_replicas: int = 0
    cpu_hourly_price: float = 0.0
    available: bool = True
    #: Hub-clock seconds since when the cluster is available again (None: long enough ago / always).
    available_since: float | None = None
    taints: tuple[Taint, ...] = ()
    cached_digests: frozenset[str] = frozenset()
    #: The spoke's platform allow-lists as an opaque key (the hub uses their canonical JSON): spokes with the
    #: same rules share it, so a deployment is checked once per distinct policy (``Deployment.refused``).
    platform_policy: str = ""
    cpu_spot_hourly_price: float | None = None

    def capacity(self, resource: str) -> int:
        if resource == CPU:
            return self.cpu_replicas
        return sum(g.count for g in self.gpus if g.type == resource)

    def price(self, resource: str) -> float:
        if resource == CPU:
            return self.cpu_hourly_price
        prices = [g.hourly_price for g in self.gpus if g.type == resource]
        return min(prices) if prices else 0.0

    def spot_price(self, resource: str) -> float | None:
        """The price of one unit on the cluster's spot nodes; None where it declares no spot pool."""
        if resource == CPU:
            return self.cpu_spot_hourly_price
        prices = [g.spot_hourly_price for g in self.gpus if g.type == resource and g.spot_hourly_price is not None]
        return min(prices) if prices else None


@dataclass(frozen=True, slots=True)
class Intent:
    """What one deployment (inline ``spec.placement``) or one PlacementPolicy asks for; None = unset."""

    mode: Mode | None = None
    regions: tuple[str, ...] = ()
    residency: tuple[str, ...] = ()
    min_regions: int | None = None
    primary_regions: tuple[str, ...] = ()
    gpu_types: tuple[str, ...] = ()
    division: Division | None = None
    weights: tuple[tuple[str, int], ...] = ()
    cluster_limits: tuple[tuple[str, int, int | None], ...] = ()
    max_replicas_per_cluster: int | None = None
    max_clusters: int | None = None
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True, slots=True)
class Policy:
    """A platform team's cluster-scoped PlacementPolicy: the highest priority matching one applies."""

    name: str
    intent: Intent
    priority: int = 0
    namespace_selector: tuple[tuple[str, str], ...] = ()

    def matches(self, namespace_labels: Mapping[str, str]) -> bool:
        return all(namespace_labels.get(k) == v for k, v in self.namespace_selector)


@dataclass(frozen=True, slots=True)
class Deployment:
    """One EmbeddingDeployment as the scheduler needs it.

    ``target`` is the total replicas wanted now (the hub's global autoscaler decides it), ``max_replicas``
    the ceiling spokes may autoscale to; ``previous`` is the last placement (cluster -> desired), which
    keeps placements sticky and lets clusters drain instead of being emptied at once; ``running`` is what
    each spoke last reported ready, so a spoke that comes back from a partition with pods still serving
    keeps them instead of being scaled to zero and ramped up again. ``refused`` maps a spoke platform
    policy key (``Cluster.platform_policy``) to why a spoke with those rules would refuse this deployment;
    the hub fills it (it needs the raw spec, which the scheduler never sees), and the SpokePolicy filter
    keeps the deployment off such spokes.
    """

    key: str
    target: int
    max_replicas: int
    intent: Intent = Intent()
    namespace_labels: tuple[tuple[str, str], ...] = ()
    gpu_type: str | None = None
    gpus_per_replica: int = 0
    digest: str | None = None
    previous: Mapping[str, int] = field(default_factory=dict)
    running: Mapping[str, int] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    #: The model's identity (learn.model_identity): keys its measured throughput and sizes its prior.
    model: str = ""
    #: The share of its replicas spec.spot lets run on spot nodes (0..1): where a cluster prices a spot pool,
    #: its cost is that mix of the spot and on-demand prices.
    spot_share: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaRange:
    """Floor, desired and cap for one spoke: the spoke's autoscaler moves inside [min, max]."""

    min: int
    desired: int
    max: int


#: `ClusterPlacement.role` of an ActivePassive deployment's warm standby (warm.py): a copy with 0 replicas.
WARM_ROLE = "warm standby"


@dataclass(slots=True)
class ClusterPlacement:
    """One cluster's share and why. ``reasons`` is built on demand: 10,000 deployments need no strings."""

    range: ReplicaRange
    region: str
    resource: str
    role: str = "spread"
    score: float = 0.0
    price: float = 0.0
    weight: str = ""
    notes: tuple[str, ...] = ()
    #: Dollars per million embeddings of a replica here (cost.py); None when placed by hourly price alone.
    cost: float | None = None
    #: Whether ``cost`` rests on measured throughput (else on the size-based prior).
    measured: bool = False
    #: The share of its replicas the spoke may run on its spot pool, priced into ``price`` and ``cost`` (0: none).
    spot: float = 0.0

    @property
    def reasons(self) -> tuple[str, ...]:
        if self.role == WARM_ROLE:
            return (WARM_ROLE, "weights kept on its nodes, no replicas")
        spot = f" (up to {self.spot:.0%} on spot)" if self.spot else ""
        out = [self.role, f"score {self.score:.0f}", f"{self.resource} at ${self.price:.2f}/h{spot}"]
        if self.cost is not None:
            out.append(money(self.cost) + ("" if self.measured else " (prior)"))
        if self.weight:
            out.append(f"weight {self.weight}")
        return (*out, *self.notes)


@dataclass(slots=True)
class Placement:
    """The decision for one deployment. ``clusters`` holds every cluster given a share (max > 0);
    ``filtered`` says why each other cluster was left out: a read-only mapping (deployments left out of the
    same clusters for the same reasons share one), in no particular order."""

    clusters: dict[str, ClusterPlacement]
    filtered: Mapping[str, str]
    accepted: bool = True
    policy: str | None = None
    mode: Mode = "ActiveActive"
    target: int = 0
    problems: tuple[str, ...] = ()
    #: ActivePassive: the standby region's clusters that keep the weights warm with no replica (warm.py).
    warm: tuple[str, ...] = ()

    def share(self, name: str, region: str = "") -> ClusterPlacement | None:
        """``name``'s share: its replicas, a warm standby's empty one, or None (nothing to run there)."""
        if not self.accepted:
            return None
        share = self.clusters.get(name)
        if share is None and name in self.warm:
            share = ClusterPlacement(ReplicaRange(0, 0, 0), region, "", role=WARM_ROLE)
        return share

    @property
    def placed(self) -> int:
        return sum(c.range.desired for c in self.clusters.values())

    def desired(self) -> dict[str, int]:
        return {name: c.range.desired for name, c in self.clusters.items() if c.range.desired > 0}


def money(cost: float) -> str:
    """``$0.41/M embeddings``; two significant digits below a cent (a CPU pool for a tiny model is that
    cheap, and ``$0.00`` would hide which of two such pools is cheaper)."""
    if not math.isfinite(cost):
        return "cost unknown"
    text = f"{cost:.2f}" if cost >= 0.01 or cost == 0 else f"{cost:.2g}"
    return f"${text}/M embeddings"
