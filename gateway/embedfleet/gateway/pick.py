"""Which replica gets the next request: the one with the least expected wait.

A replica's expected wait is what it last reported (its queue's expected wait, from the answer
header or the /load poll, whichever is newer) plus the requests this gateway has in flight to it
times its measured mean service time: the work we sent that its report may not count yet. Ties go to
the replica with the fewest requests in flight, then to a random one, so identical replicas share
the load. Replicas that are ready come first; saturated ("busy") ones take work only when no replica
is ready, and the runtime's own admission answers for them. Down and draining replicas never do.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable
from typing import Protocol, TypeVar


class State(enum.Enum):
    READY = "ready"  # answering and admitting
    BUSY = "busy"  # answering, but its /ready is false for load (saturated): last resort
    DOWN = "down"  # not answering, loading, failed, or unknown (never polled)
    DRAINING = "draining"  # shutting down: refuses new work


ROUTABLE = (State.READY, State.BUSY)  # in order of preference


class Load(Protocol):
    state: State
    reported_wait_s: float
    in_flight: int
    service_s: float


R = TypeVar("R", bound=Load)


def expected_wait(replica: Load) -> float:
    return replica.reported_wait_s + replica.in_flight * replica.service_s


def pick(replicas: Iterable[R], rng: random.Random) -> R | None:
    """The least-wait replica of the best routable state, or None when none can take work."""
    replicas = list(replicas)
    for state in ROUTABLE:
        best: list[R] = []
        best_key: tuple[float, int] | None = None
        for replica in replicas:
            if replica.state is not state:
                continue
            key = (round(expected_wait(replica), 6), replica.in_flight)  # rounding: equal loads tie exactly
            if best_key is None or key < best_key:
                best, best_key = [replica], key
            elif key == best_key:
                best.append(replica)
        if best:
            return best[0] if len(best) == 1 else rng.choice(best)
    return None


def pick_in_turn(replicas: Iterable[R], turn: int) -> R | None:
    """Round-robin, for benchmarks only (--balance round-robin): the `turn`-th replica of the best
    routable state, blind to load."""
    replicas = list(replicas)
    for state in ROUTABLE:
        tier = [r for r in replicas if r.state is state]
        if tier:
            return tier[turn % len(tier)]
    return None
