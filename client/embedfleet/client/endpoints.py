"""Several endpoints of one model (e.g. one per region): which one gets the next request.

`pick_endpoint` is the whole routing policy, a pure function over a snapshot of each endpoint's
health, latency and load. `EndpointPool` only keeps those numbers up to date.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

# Latency smoothing: the last ~5 observations dominate, so a region that slows down loses traffic
# within a few requests, but one slow reply does not flip the preference.
EWMA_ALPHA = 0.2
# Consecutive failures (5xx, 429) before an endpoint that still answers is treated as unhealthy.
FAILURES_TO_UNHEALTHY = 3


def normalise_base_url(url: str) -> str:
    """Base URL without a trailing slash or `/v1`, so routes can be appended uniformly."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint URL must start with http:// or https://: {url!r}")
    return url


@dataclass
class Endpoint:
    """What the client knows about one endpoint right now."""

    url: str
    healthy: bool = True
    latency: float | None = None  # EWMA of successful request (or probe) latency, seconds
    in_flight: int = 0
    consecutive_failures: int = 0
    unhealthy_since: float | None = None
    requests: int = 0
    failures: int = 0
    extra: dict[str, str] = field(default_factory=dict)  # per-endpoint discoveries (e.g. classify route)


def pick_endpoint(
    endpoints: Sequence[Endpoint],
    *,
    spread: bool = False,
    exclude: Sequence[str] = (),
    now: float | None = None,
    recheck_after: float = 5.0,
) -> Endpoint:
    """The endpoint for the next request.

    - Healthy endpoints first; an unhealthy one becomes a candidate again `recheck_after` seconds
      after it failed (half-open), and when nothing else is left.
    - `exclude` (endpoints that just failed this request) is honoured while anything else remains.
    - Without `spread`: the lowest-latency candidate (ties and unknown latencies go to list order).
      With `spread`: the one with the lowest expected wait, latency x (in-flight + 1), so a backfill
      uses every region in proportion to how fast each answers.
    """
    if not endpoints:
        raise ValueError("no endpoints configured")
    now = time.monotonic() if now is None else now

    def usable(e: Endpoint) -> bool:
        return e.healthy or (e.unhealthy_since is not None and now - e.unhealthy_since >= recheck_after)

    pools = [
        [e for e in endpoints if usable(e) and e.url not in exclude],
        [e for e in endpoints if usable(e)],
        [e for e in endpoints if e.url not in exclude],
        list(endpoints),
    ]
    candidates = next(p for p in pools if p)
    known = [e.latency for e in candidates if e.latency is not None]
    default_latency = min(known) if known else 1.0
    order = {e.url: i for i, e in enumerate(endpoints)}

    def cost(e: Endpoint) -> tuple[float, int]:
        latency = e.latency if e.latency is not None else default_latency
        if spread:
            return (latency * (e.in_flight + 1), order[e.url])
        return (latency, order[e.url])

    return min(candidates, key=cost)


class EndpointPool:
    """Mutable health/latency state for a list of endpoints, updated from request outcomes."""

    def __init__(self, urls: Sequence[str], *, spread: bool = False, recheck_after: float = 5.0) -> None:
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("at least one endpoint URL is required")
        seen: dict[str, Endpoint] = {}
        for url in urls:
            base = normalise_base_url(url)
            seen.setdefault(base, Endpoint(base))
        self.endpoints = list(seen.values())
        self.spread = spread
        self.recheck_after = recheck_after

    def choose(self, exclude: Sequence[str] = ()) -> Endpoint:
        return pick_endpoint(
            self.endpoints, spread=self.spread, exclude=exclude, recheck_after=self.recheck_after
        )

    def started(self, e: Endpoint) -> None:
        e.in_flight += 1
        e.requests += 1

    def finished(self, e: Endpoint) -> None:
        e.in_flight = max(0, e.in_flight - 1)

    def success(self, e: Endpoint, latency: float) -> None:
        e.latency = latency if e.latency is None else (1 - EWMA_ALPHA) * e.latency + EWMA_ALPHA * latency
        e.consecutive_failures = 0
        e.healthy = True
        e.unhealthy_since = None

    def failure(self, e: Endpoint, *, hard: bool) -> None:
        """Record a failed request; `hard` (nothing answered) marks the endpoint unhealthy at once."""
        e.failures += 1
        e.consecutive_failures += 1
        if hard or e.consecutive_failures >= FAILURES_TO_UNHEALTHY:
            e.healthy = False
            e.unhealthy_since = time.monotonic()

    def probed(self, e: Endpoint, ok: bool, latency: float | None) -> None:
        if ok:
            if latency is not None:
                self.success(e, latency)
            else:
                e.healthy, e.unhealthy_since = True, None
        else:
            e.healthy = False
            e.unhealthy_since = time.monotonic()
