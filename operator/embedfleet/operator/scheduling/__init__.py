"""The hub's global scheduler: pure functions from deployments + cluster inventory + policies to
per-cluster replica ranges. Nothing here imports kopf or talks to an API server (see embedfleet.operator.hub).

Pipeline (one small module per stage): ``policy`` (resolve the platform PlacementPolicy, reject contradicting
inline fields) -> ``filters`` (health, region lock, residency, GPU type, taints) -> ``scores`` (free
capacity, price, cached weights, stickiness) -> ``divide`` (duplicated, or weighted-divided under caps and
floors) -> ``place`` (the one entry point, capacity accounting, failover and gradual move back).
"""

from embedfleet.operator.scheduling.model import (
    Cluster,
    ClusterPlacement,
    Deployment,
    GPUCapacity,
    Intent,
    Placement,
    Policy,
    ReplicaRange,
    Taint,
    Toleration,
)
from embedfleet.operator.scheduling.place import place

__all__ = [
    "Cluster",
    "ClusterPlacement",
    "Deployment",
    "GPUCapacity",
    "Intent",
    "Placement",
    "Policy",
    "ReplicaRange",
    "Taint",
    "Toleration",
    "place",
]
