"""Which number is the autoscaler's in-flight target per replica (at full use), and whether it is borrowed.

Pure: a spec dict in, a `Target` out. The spokes' autoscaler (handlers/autoscale_daemon.py), the hub's
fleet target (hub/autoscale.py) and the ``Accepted`` condition (handlers/embedding.py) all ask this one
function, so they never disagree.

The rule, in order:

1. ``spec.autoscaling.inFlightPerReplica`` set: that number.
2. else ``spec.runtime.maxBatchRequests`` set to something other than its default: that number, with a
   deprecation to report while autoscaling is on (with it off nothing borrows the number). It is the
   runtime's inputs per engine batch, a different unit; the autoscaler borrows it so that objects
   written before inFlightPerReplica existed keep their target.
3. else `DEFAULT_IN_FLIGHT_PER_REPLICA` (32), no deprecation.

Why "other than its default" and not "present in the dict": earlier versions of the CRD schema defaulted
``runtime.maxBatchRequests`` to 32, so objects written then hold 32 whether the user wrote it or not (the
field has no default now: unset, the runtime sizes its batches itself). A stored 32 and an unset field give
the same target (32), so nothing is borrowed in effect and nothing is reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from embedfleet.operator.crd.models import EmbeddingDeploymentSpec

#: The target per replica (before targetUtilization) of a spec that sets neither field.
DEFAULT_IN_FLIGHT_PER_REPLICA = 32
#: spec.runtime.maxBatchRequests' former CRD default (objects written before it was dropped hold it).
RUNTIME_MAX_BATCH_REQUESTS_DEFAULT = 32
DEPRECATION_REASON = "Deprecated"

Source = Literal["inFlightPerReplica", "maxBatchRequests", "default"]


@dataclass(frozen=True)
class Target:
    """The in-flight requests one replica carries at full use, where that number came from, and the
    sentence to show the user when it is borrowed from spec.runtime.maxBatchRequests."""

    per_replica: int
    source: Source
    deprecation: str | None = None


def deprecation_message(max_batch_requests: int) -> str:
    return (
        f"spec.runtime.maxBatchRequests ({max_batch_requests}) is the runtime's inputs per engine batch; "
        "the autoscaler's in-flight target borrows it only until spec.autoscaling.inFlightPerReplica is set "
        "(deprecated)"
    )


def _get(spec: Mapping[str, Any] | None, block: str, key: str) -> Any:
    inner = (spec or {}).get(block)
    return inner.get(key) if isinstance(inner, Mapping) else None


def in_flight_target(spec: Mapping[str, Any] | None) -> Target:
    """The rule in the module docstring, on an EmbeddingDeployment's camelCase ``spec`` as stored (or a
    parsed spec dumped with ``exclude_unset``: `of_parsed`). Values are taken as the schema let them in."""
    own = _get(spec, "autoscaling", "inFlightPerReplica")
    if own is not None:
        return Target(int(own), "inFlightPerReplica")
    batch = _get(spec, "runtime", "maxBatchRequests")
    if batch is not None and int(batch) != RUNTIME_MAX_BATCH_REQUESTS_DEFAULT:
        enabled = _get(spec, "autoscaling", "enabled") is not False
        return Target(int(batch), "maxBatchRequests", deprecation_message(int(batch)) if enabled else None)
    return Target(DEFAULT_IN_FLIGHT_PER_REPLICA, "default")


def of_parsed(spec: EmbeddingDeploymentSpec) -> Target:
    """`in_flight_target` of a parsed spec: only the fields its source named count as set."""
    return in_flight_target(spec.model_dump(by_alias=True, exclude_unset=True))
