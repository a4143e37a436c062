"""Global autoscaling: the fleet-wide replica target from the in-flight load all spokes report. Pure.

Same target per replica as the spokes' autoscaler (``inFlightPerReplica * targetUtilization``, the number
chosen by autoscale_target.py) and the same tolerance band; the finer machinery (panic/stable windows, rate
limits) stays on the spokes, which scale inside the floors and caps the hub derives from this target
(placement divides it by weight).
"""

from __future__ import annotations

import math

from embedfleet.operator.autoscale_target import of_parsed
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec


def fleet_target(spec: EmbeddingDeploymentSpec, inflight: float | None, previous: int | None) -> int:
    auto = spec.autoscaling
    if not auto.enabled:
        return spec.replicas if spec.replicas is not None else auto.min_replicas
    floor = 0 if auto.scale_to_zero else auto.min_replicas
    start = previous if previous is not None else (spec.replicas if spec.replicas is not None else max(floor, 1))
    if inflight is None:
        return max(floor, min(auto.max_replicas, start))
    per_replica = of_parsed(spec).per_replica * auto.target_utilization
    wanted = math.ceil(inflight / per_replica) if inflight > 0 else 0
    if start > 0 and abs(wanted / start - 1.0) <= auto.tolerance:
        wanted = start
    return max(floor, min(auto.max_replicas, wanted))
