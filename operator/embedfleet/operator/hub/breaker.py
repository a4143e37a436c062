"""A per-spoke circuit breaker for the hub's writes. Pure.

A spoke whose writes keep failing for reasons of its own (connection refused or reset, time-outs, 5xx) is
left alone for a while instead of being retried at every placement pass: its writes wait, the other spokes' do not, and
each retry is one probe batch. A spec the spoke refuses (4xx) says nothing about the spoke and never opens
the breaker. Back-off doubles from ``base`` to ``cap``, as client-go's and Envoy's do.
"""

from __future__ import annotations

from dataclasses import dataclass

THRESHOLD = 3  # consecutive failed batches before the breaker opens
BASE_SECONDS = 2.0
CAP_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Breaker:
    failures: int = 0  # consecutive failed batches
    open_until: float = 0.0  # monotonic seconds; writes wait until then
    last_error: str = ""

    def allows(self, now: float) -> bool:
        return now >= self.open_until

    def is_open(self, now: float) -> bool:
        return not self.allows(now)

    def succeeded(self) -> Breaker:
        return Breaker()

    def failed(self, now: float, error: str, threshold: int = THRESHOLD, base: float = BASE_SECONDS,
               cap: float = CAP_SECONDS) -> Breaker:
        failures = self.failures + 1
        if failures < threshold:
            return Breaker(failures, 0.0, error)
        return Breaker(failures, now + min(cap, base * 2 ** (failures - threshold)), error)
