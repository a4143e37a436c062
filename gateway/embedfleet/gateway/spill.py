"""Cross-region spill: sending a request to another region's gateway when this region cannot serve it soon.

Which regions a deployment may spill to is the placement policy's decision, made by the hub
(operator/scheduling/spill.py) and handed to each spoke's copy of the EmbeddingDeployment in the
annotation `embedfleet.dev/spill-to`; locally, `--spill NAME=REGION=URL`. The gateway never widens it:
no targets, no spill (RegionLocked to one region, or a standby that runs nothing yet), and the request
is held or refused here as it would be without spill.

When (the threshold: the deployment's `spec.placement.spillAfterSeconds`, else `--spill-after`):
* cold (`should_spill`): the deployment has no replica here that can take work and its expected cold
  start (the learned time, less how long it has already been cold) is over the threshold;
* queue (`should_spill_queue`): it has replicas here, but every one that may take the request is over
  `queue_bound` for the request's class, with shed.py's meaning of "over" (a query: a reported wait
  over the bound *and* saturated; bulk work: the reported wait alone). This is checked before
  shedding, so a region with somewhere to spill spills instead of answering 429.
A request that was itself spilled (`x-embedfleet-spilled-from`) is never spilled again, so two regions
cannot bounce a request.
Where: the first target not marked down in the last DOWN_FOR_S (targets are in the hub's order:
best-scored region first). A target whose gateway answers that it cannot take the request either
(`refused_there`: 429 `overloaded`, its replicas past their bounds; 503 `cold_start` / `hold_full` /
`draining`) ran nothing, so the request goes on to the next target, or back to this region's own
hold or shedding when none is left, and that target is skipped for DOWN_FOR_S: a busy region is
learned from its own refusals, with no polling.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from embedfleet.gateway.pick import ROUTABLE, Load
from embedfleet.gateway.shed import over

SPILLED_FROM = "x-embedfleet-spilled-from"  # header on a spilled request: the region it left
ANNOTATION = "embedfleet.dev/spill-to"  # on a spoke's EmbeddingDeployment: JSON list of {cluster, region, url}
DOWN_FOR_S = 10.0  # a target whose gateway did not take a request is skipped this long
COLD, QUEUE = "cold", "queue"  # why a request spilled (the `reason` label of embedfleet_gateway_spilled_total)


@dataclass(eq=False, slots=True)
class Target:
    """Another region's gateway for one deployment."""

    region: str
    url: str
    down_at: float = -math.inf  # when it last failed to take a request


def parse_annotation(raw: str | None) -> list[Target]:
    """The hub's `embedfleet.dev/spill-to` value -> targets; anything malformed is no target at all (a
    broken annotation must not send requests somewhere the policy did not name)."""
    if not raw:
        return []
    try:
        items = json.loads(raw)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    out = []
    for item in items:
        if not isinstance(item, dict):
            return []
        region, url = item.get("region"), item.get("url")
        parts = urlsplit(url) if isinstance(url, str) else None
        if not isinstance(region, str) or parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            return []
        out.append(Target(region, url.rstrip("/")))
    return out


def should_spill(routable_here: bool, spilled_in: bool, cold_remaining_s: float, spill_after_s: float,
                 targets: Sequence[Target]) -> bool:
    """Pure: spill when nothing here can take the request, the wait for a cold start here is over the
    threshold, the request did not come from another region, and the policy named somewhere to go."""
    return (not routable_here and not spilled_in and bool(targets) and cold_remaining_s > spill_after_s)


def queue_bound(spill_after_s: float, shed_bound_s: float, bulk: bool) -> float:
    """Pure: the reported wait over which a request of this class leaves for another region. A query: the
    spill threshold, or the shed bound when that is lower (what would be refused here spills instead);
    bulk work is meant to queue, so it leaves only where it would be refused: at its shed bound, never
    when shedding is off for it (0)."""
    if bulk:
        return shed_bound_s if shed_bound_s > 0 else math.inf
    return min(spill_after_s, shed_bound_s) if shed_bound_s > 0 else spill_after_s


def should_spill_queue(replicas: Iterable[Load], bound_s: float, bulk: bool, spilled_in: bool,
                       targets: Sequence[Target]) -> bool:
    """Pure: spill a request the deployment has replicas for when every one that can take work is over
    `bound_s` (shed.over: a query only where the replica is also saturated), the request did not come from
    another region, and the policy named somewhere to go. No routable replica: not this rule (`should_spill`)."""
    if spilled_in or not targets:
        return False
    routable = [r for r in replicas if r.state in ROUTABLE]
    return bool(routable) and all(over(r, bound_s, bulk) for r in routable)


REFUSED_THERE = {429: frozenset({"overloaded"}), 503: frozenset({"cold_start", "hold_full", "draining"})}


def refused_there(status: int, raw: bytes) -> bool:
    """Pure: did another region's gateway answer that it could not take the request (its replicas over
    their bounds, none ready, or draining)? Such a request ran nowhere and may go elsewhere. Any other
    answer, a tenant's `quota_exceeded` included, is the answer."""
    codes = REFUSED_THERE.get(status)
    if codes is None:
        return False
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") in codes


def choose(targets: Sequence[Target], now: float) -> Target | None:
    """The first target (the hub's order) not marked down within DOWN_FOR_S."""
    return next((t for t in targets if now - t.down_at >= DOWN_FOR_S), None)
