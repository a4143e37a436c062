"""Outlier ejection (Envoy's, simplified): a replica that fails `after` requests in a row is not picked
for a back-off period, then tried again.

Pure state per replica. A failure is a connection that could not be made or an answer 5xx other
than 503 `draining` (a replica shutting down, handled apart) and 504 (a deadline the client set; it
says nothing of the replica); 429 and every other answer are successes: the replica is alive and
judging requests. The first ejection lasts `base_s`; a replica that fails again on its first request
after coming back (on probation) is ejected for twice as long, up to `max_s`; one success clears all.

When every routable replica of a deployment is ejected, none is (`admitted`): a fleet that fails
everything is better tried than held or refused by the gateway on a guess (Envoy's panic threshold).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from embedfleet.gateway.pick import ROUTABLE, State

CONSECUTIVE_FAILURES = 5  # Envoy's consecutive_5xx default
BASE_S = 5.0
MAX_S = 60.0


def is_failure(status: int, draining: bool = False) -> bool:
    """An answer's status: does it count against the replica?"""
    return status >= 500 and status != 504 and not (status == 503 and draining)


@dataclass(slots=True)
class Ejection:
    failures: int = 0  # in a row, since the last success or ejection
    ejections: int = 0  # in a row, without a success between: the back-off's exponent
    until: float = -math.inf  # time.monotonic() when the current ejection ends

    def ejected(self, now: float) -> bool:
        return now < self.until

    def succeeded(self) -> None:
        self.failures = self.ejections = 0

    def failed(self, now: float, after: int = CONSECUTIVE_FAILURES, base_s: float = BASE_S,
               max_s: float = MAX_S) -> bool:
        """Count a failure at `now`; True when it ejects the replica (a new ejection begins)."""
        if self.ejected(now):  # an answer to a request sent before the ejection: already counted out
            return False
        self.failures += 1
        on_probation = self.ejections > 0  # came back from an ejection and has not succeeded since
        if self.failures < after and not on_probation:
            return False
        self.until = now + min(max_s, base_s * 2 ** self.ejections)
        self.ejections += 1
        self.failures = 0
        return True


class Ejectable(Protocol):
    state: State
    ejection: Ejection


E = TypeVar("E", bound=Ejectable)


def admitted(replicas: Iterable[E], now: float) -> list[E]:
    """The replicas that may be picked: all but the ejected ones, unless every routable one is ejected."""
    replicas = list(replicas)
    kept = [r for r in replicas if not r.ejection.ejected(now)]
    if any(r.state in ROUTABLE for r in kept):
        return kept
    return replicas
