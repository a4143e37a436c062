"""How long a deployment takes to become ready from cold, learned from what the gateway saw.

Pure: an exponentially weighted mean of hold -> ready durations (the oldest held request's wait when
a replica became ready), seeded by a default until the first is seen. A hold that times out before
any replica is ready says the cold start takes at least that long: it raises a lower estimate to
that, and never lowers one. Clients refused while the deployment is cold are told to come back
when the cold start is expected to be over (Retry-After).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_COLD_START_S = 30.0
ALPHA = 0.3  # weight of the newest observation


@dataclass
class ColdStart:
    default_s: float = DEFAULT_COLD_START_S
    alpha: float = ALPHA
    learned_s: float | None = None
    observations: int = 0

    def expected_s(self) -> float:
        return self.default_s if self.learned_s is None else self.learned_s

    def observe(self, duration_s: float) -> None:
        """A cold start that took `duration_s` (hold -> ready)."""
        duration_s = max(0.0, duration_s)
        self.learned_s = duration_s if self.learned_s is None else \
            self.alpha * duration_s + (1 - self.alpha) * self.learned_s
        self.observations += 1

    def observe_at_least(self, duration_s: float) -> None:
        """A hold gave up after `duration_s` with no replica ready: the cold start takes longer."""
        if duration_s > self.expected_s():
            self.learned_s = duration_s
            self.observations += 1

    def retry_after(self, waited_s: float) -> int:
        """Whole seconds until the deployment is expected to be ready, when it has been cold for
        `waited_s` (at least 1: it is not ready now)."""
        return max(1, math.ceil(self.expected_s() - max(0.0, waited_s)))
