"""Global autoscaling: the fleet-wide replica target from the in-flight load all spokes report. Pure.

Same target per replica as the spokes' autoscaler (``inFlightPerReplica * targetUtilization``, the number
chosen by autoscale_target.py) and the same tolerance band; the finer machinery (panic/stable windows, rate
limits) stays on the spokes, which scale inside the floors and caps the hub derives from this target
(placement divides it by weight). An open ``spec.autoscaling.schedule`` window raises the floor here, for
the whole fleet (spokes' copies leave it to the hub: autoscale_daemon.with_schedule).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

from embedfleet.operator.autoscale_schedule import scheduled_floor
from embedfleet.operator.autoscale_target import of_parsed
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec


def fleet_target(spec: EmbeddingDeploymentSpec, inflight: float | None, previous: int | None,
                 now: datetime | None = None) -> int:
    """``now`` (aware; the wall clock when None) decides which schedule windows are open."""
    auto = spec.autoscaling
    if not auto.enabled:
        return spec.replicas if spec.replicas is not None else auto.min_replicas
    floor = 0 if auto.scale_to_zero else auto.min_replicas
    if auto.schedule:
        scheduled = scheduled_floor(auto.schedule, now if now is not None else datetime.now(UTC)).floor
        floor = max(floor, min(scheduled, auto.max_replicas))
    start = previous if previous is not None else (spec.replicas if spec.replicas is not None else max(floor, 1))
    if inflight is None:
        return max(floor, min(auto.max_replicas, start))
    per_replica = of_parsed(spec).per_replica * auto.target_utilization
    wanted = math.ceil(inflight / per_replica) if inflight > 0 else 0
    if start > 0 and abs(wanted / start - 1.0) <= auto.tolerance:
        wanted = start
    return max(floor, min(auto.max_replicas, wanted))
