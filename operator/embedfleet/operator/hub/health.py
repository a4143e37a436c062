"""Spoke health from its heartbeat lease, judged on the hub's own clock. Pure.

The hub never compares the spoke's ``renewTime`` with its own clock (clocks drift); it records *when it
saw* the renewTime change, like the node lifecycle controller does with probe timestamps. A spoke is
unavailable only when no renewal was seen for ``duration + grace`` seconds: one late or missed heartbeat
is absorbed by the lease duration, several by the grace period.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Health:
    joined: bool = False
    available: bool = False
    renew_time: str | None = None
    last_heartbeat: float | None = None  # hub monotonic-ish seconds when the renewal was seen
    available_since: float | None = None
    reason: str = "NeverSeen"


def observe(
    previous: Health, renew_time: str | None, now: float, duration: float, grace: float,
    first_sight_age: float | None = None,
) -> Health:
    """The next health state, from one look at the spoke's lease (``renew_time`` None: unreachable/absent).

    The very first look (hub just started) cannot see a change, so it trusts the lease's own age on the
    wall clock (``first_sight_age``), and such a cluster is not treated as *returning* (no ramp): a hub
    restart must neither fail over nor slow-start the whole fleet.
    """
    first = previous.renew_time is None and previous.last_heartbeat is None
    if first and renew_time is not None and first_sight_age is not None:
        if first_sight_age <= duration + grace:
            reason = "LeaseValid" if first_sight_age <= duration else "LeaseInGrace"
            return Health(True, True, renew_time, now - max(0.0, first_sight_age), None, reason)
        return Health(True, False, renew_time, now - first_sight_age, None, "LeaseExpired")
    renewed = renew_time is not None and renew_time != previous.renew_time
    last = now if renewed else previous.last_heartbeat
    joined = previous.joined or renewed
    if last is None:
        return Health(joined, False, previous.renew_time, None, None, "NeverSeen")
    age = now - last
    if age <= duration + grace:
        since = previous.available_since if previous.available else now
        reason = "LeaseValid" if age <= duration else "LeaseInGrace"
        return Health(joined, True, renew_time if renewed else previous.renew_time, last, since, reason)
    return Health(joined, False, previous.renew_time, last, None, "LeaseExpired")


def next_change(health: Health, now: float, duration: float, grace: float) -> float | None:
    """Seconds from ``now`` until ``health`` changes by itself if no renewal is seen meanwhile (valid ->
    in grace -> expired); None when time alone changes nothing (expired, or never seen). The hub looks at
    the spoke again then, so a spoke that goes silent is judged on time without a periodic sweep."""
    if not health.available or health.last_heartbeat is None:
        return None
    age = now - health.last_heartbeat
    for edge in (duration, duration + grace):
        if age <= edge:  # observe() changes its reason once the age is past the edge
            return edge - age
    return 0.0
