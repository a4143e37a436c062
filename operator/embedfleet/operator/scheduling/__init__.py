"""The hub's global scheduler: pure functions from deployments + cluster inventory + policies to
per-cluster replica ranges. Nothing here imports kopf or talks to an API server (see embedfleet.operator.hub).

Pipeline (one small module per stage): ``policy`` (resolve the platform PlacementPolicy, reject contradicting
inline fields) -> ``filters`` (health, region lock, residency, GPU type, taints) -> ``scores`` (one plugin per
file: free capacity, price, stickiness, cached weights) -> ``divide`` (duplicated, or weighted-divided under
caps and floors) -> ``place`` (the one entry point, capacity accounting, failover and gradual move back).
``place`` works on arrays: ``inventory`` (the clusters' pools, each rules' candidates), ``pipeline`` (every
step for one deployment), ``even`` (the common case's shortcut), ``shares`` (scores and ranges of all placed
clusters in one batch).
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
