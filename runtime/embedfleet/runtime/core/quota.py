"""A tenant's tokens-per-minute quota, as a token bucket with pure arithmetic.

A bucket holds at most one minute of quota (a tenant idle for a minute may send a minute's worth
at once, as OpenAI's and Cohere's per-minute limits allow) and refills continuously at quota/60
tokens per second. A request takes its tokens (counted after tokenization, so a tenant pays for
what the engine runs, not for characters) or is refused with the seconds after which the same
request would fit. Refused requests take nothing; work refused later (admission, a deadline) is
given back, so a tenant never pays for a 429.

The bucket is per replica: N replicas let a tenant through at up to N times the quota. The
operator states this next to the field; a fleet-wide limit belongs in the gateway in front.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EPSILON = 1e-6  # refill arithmetic in floats: a request that fits exactly after `retry_after` must fit


@dataclass(frozen=True, slots=True)
class Bucket:
    capacity: float  # tokens: one minute of quota
    level: float  # tokens available at `at`
    at: float  # time.monotonic() of `level`

    @classmethod
    def full(cls, tokens_per_minute: int, now: float) -> Bucket:
        return cls(float(tokens_per_minute), float(tokens_per_minute), now)

    @property
    def rate(self) -> float:
        """Tokens per second refilled."""
        return self.capacity / 60.0

    def at_time(self, now: float) -> Bucket:
        if now <= self.at:
            return self
        return Bucket(self.capacity, min(self.capacity, self.level + (now - self.at) * self.rate), now)


@dataclass(frozen=True, slots=True)
class Take:
    ok: bool
    bucket: Bucket  # the bucket after the attempt (unchanged but refilled when refused)
    retry_after: int  # whole seconds until the same request fits; 0 when taken
    never: bool = False  # the request alone is larger than a minute of quota: no wait makes it fit


def take(bucket: Bucket, tokens: int, now: float) -> Take:
    """Take `tokens` now, or say when they would fit.

    Properties (tested with hypothesis): a refusal leaves the level unchanged; taken tokens never
    exceed what the bucket held; after `retry_after` seconds with nothing else taken, the same
    request is taken (unless `never`); the level stays within [0, capacity].
    """
    current = bucket.at_time(now)
    if tokens <= current.level + EPSILON * max(1.0, current.rate):
        return Take(True, Bucket(current.capacity, max(0.0, current.level - tokens), now), 0)
    if tokens > current.capacity:
        return Take(False, current, 60, never=True)
    return Take(False, current, max(1, math.ceil((tokens - current.level) / current.rate - EPSILON)))


def give_back(bucket: Bucket, tokens: int, now: float) -> Bucket:
    """Return tokens taken for work that was then refused (never above capacity)."""
    current = bucket.at_time(now)
    return Bucket(current.capacity, min(current.capacity, current.level + tokens), now)
