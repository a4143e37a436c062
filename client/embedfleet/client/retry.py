"""Retry and hedging decisions, kept pure so they can be tested without a network.

Backoff is exponential with "equal jitter" (half fixed, half random): clients that failed together
do not retry together, yet no retry fires immediately after a failure. A server's `Retry-After`
is a floor, never shortened by jitter.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed request is re-sent."""

    max_retries: int = 5
    initial_backoff: float = 0.125
    max_backoff: float = 8.0
    multiplier: float = 2.0
    max_retry_after: float = 60.0

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Delay before retry number `attempt` (0-based), ignoring any Retry-After."""
        rng = rng or random
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** max(attempt, 0))
        return cap / 2 + rng.uniform(0, cap / 2)

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random | None = None) -> float:
        """Delay before retry `attempt`, honouring the server's Retry-After (capped) as a minimum."""
        base = self.backoff(attempt, rng)
        if retry_after is None:
            return base
        return max(base, min(retry_after, self.max_retry_after))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header (delta-seconds or HTTP-date); None if absent or junk."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


class HedgeBudget:
    """Allows a hedge only while hedges stay within `fraction` of the primary requests sent.

    Hedging fights tail latency; unbounded, it doubles load exactly when a server is slow. Counting
    against primaries already sent caps the extra load at `fraction` at every moment of a call.
    """

    def __init__(self, fraction: float = 0.10) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError("hedge budget must be between 0 and 1")
        self.fraction = fraction
        self.primaries = 0
        self.hedges = 0

    def record_primary(self) -> None:
        self.primaries += 1

    def try_acquire(self) -> bool:
        if self.hedges + 1 <= self.fraction * self.primaries:
            self.hedges += 1
            return True
        return False
