"""Shedding at the gateway: refuse at once, with 429 `overloaded`, a request that every replica would
refuse for its expected wait anyway, instead of sending it down to be refused there.

Pure. A replica's reported wait (its queue's expected wait, from its answers' header or its last
`GET /load` poll) is the wait of work queued behind everything it holds: what a bulk request waits.
Queries (interactive requests) jump ahead of bulk work in the runtime, so a replica running a long
backfill reports a long wait yet takes queries at once; for a query, a replica is over the bound only
when its reported wait is over it *and* it says it is saturated (the runtime's own verdict that a
small request would be refused now). A bulk request is judged by the reported wait alone, against
the bulk bound.

Retry-After: whole seconds until the least-loaded replica is expected back under the bound, at least 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from embedfleet.gateway.pick import ROUTABLE, Load, State


@dataclass(frozen=True, slots=True)
class Shed:
    retry_after: int  # seconds
    least_wait_s: float  # the least-loaded replica's reported wait


def over(replica: Load, bound_s: float, bulk: bool) -> bool:
    """Would `replica` refuse this request for its expected wait?"""
    if replica.reported_wait_s <= bound_s:
        return False
    return bulk or replica.state is State.BUSY


def decide(replicas: Iterable[Load], bound_s: float, bulk: bool) -> Shed | None:
    """Shed (with the Retry-After to send) when every routable replica is over `bound_s`; None when any
    can take the request, when none is routable (the request is held instead), or when the bound is 0
    (shedding off)."""
    if bound_s <= 0:
        return None
    routable = [r for r in replicas if r.state in ROUTABLE]
    if not routable or not all(over(r, bound_s, bulk) for r in routable):
        return None
    least = min(r.reported_wait_s for r in routable)
    return Shed(max(1, math.ceil(least - bound_s)), least)
