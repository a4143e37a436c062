"""``spec.spot`` and ``status.spot``: how much of a deployment may run on spot (preemptible) nodes, and what
stands in when spot nodes are reclaimed. The decisions live in embedfleet.operator.spot; this is the shape.

``max`` reads like a Deployment's maxSurge: an integer is a replica count, ``"70%"`` a share of the
replicas (rounded down, so 70% of 1 replica is none: a lone replica never rides on spot).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, WithJsonSchema

from embedfleet.operator.crd.base import CamelModel

SPOT_MAX_PATTERN = r"^(100|[1-9]?[0-9])%$"


def _spot_max(value: object) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("spot.max must be a replica count (e.g. 3) or a percentage (e.g. \"70%\")")
    if isinstance(value, int):
        if not 0 <= value <= 10000:
            raise ValueError(f"spot.max {value} is out of range: a count from 0 to 10000")
        return value
    if not re.match(SPOT_MAX_PATTERN, value):
        raise ValueError(f"spot.max {value!r} is neither a count nor a percentage from 0% to 100%")
    return value


SpotMax = Annotated[
    int | str,
    BeforeValidator(_spot_max),
    WithJsonSchema({
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 10000},
                  {"type": "string", "pattern": SPOT_MAX_PATTERN}],
    }),
]


class SpotSpec(CamelModel):
    """Run up to ``max`` replicas on the platform's spot nodes, the rest on on-demand nodes."""

    max: SpotMax = Field(description="Replicas that may run on spot nodes: a count, or a share like \"70%\".")
    fallback: Literal["onDemand", "none"] = Field(
        default="onDemand",
        description="onDemand: a spot replica that is not serving (pending for lack of spot capacity, or on a "
        "node being reclaimed) is replaced on on-demand nodes until spot capacity serves again. none: wait "
        "for spot capacity.",
    )
    return_after_seconds: float = Field(
        default=60, ge=0, le=3600,
        description="How long spot replicas must serve again before the on-demand stand-ins are removed.",
    )


class SpotStatus(CamelModel):
    """The split the operator applies: ``onDemand`` includes the stand-ins (``fallback``). ``total`` is
    required so that the schema gives the block no default: absent, it says the deployment runs no spot."""

    total: int = Field(ge=0, description="The replicas split: the autoscaler's, else spec.replicas.")
    spot: int = Field(default=0, ge=0, description="Replicas the spot Deployment asks for.")
    on_demand: int = Field(default=0, ge=0, description="Replicas the on-demand Deployment asks for.")
    serving: int = Field(default=0, ge=0, description="Spot replicas ready on nodes not being reclaimed.")
    fallback: int = Field(default=0, ge=0, description="On-demand replicas standing in for spot ones.")
    reclaimed: list[str] = Field(default_factory=list, description="Spot nodes being reclaimed, and why.")
