"""The warm standby of an ActivePassive deployment: where its weights wait, with no replica and no GPU held,
for the failover that moves its replicas there. Pure.

While the primary regions serve, the full pipeline gives the standby region nothing, so a failover used to
start from a cold node cache (the origin download of every weight file) exactly when the fleet is short.
The hub now also names the standby region's clusters here; each gets a copy with 0 replicas, whose node
agents pre-pull the weights (spec.cache.prePull). Which region: the one a failover would pick given what
is known without scoring again: clusters that already report the weights cached first, then the most free
capacity of the deployment's pool (after every placement of this round), then by name.
"""

from __future__ import annotations

import numpy as np

from embedfleet.operator.scheduling.inventory import Group, Inventory
from embedfleet.operator.scheduling.model import WARM_ROLE, Placement

__all__ = ["WARM_ROLE", "warm_standby"]


def warm_standby(placement: Placement, g: Group, inventory: Inventory, digest: str | None) -> tuple[str, ...]:
    """The standby region's candidates to keep warm, in name order; none unless the deployment is
    ActivePassive, accepted, placed, and served from its primary regions only (a standby already serving
    holds its weights anyway)."""
    if placement.mode != "ActivePassive" or not placement.accepted or not placement.clusters:
        return ()
    placed = [g.position.get(name) for name in placement.clusters]
    if any(p is None or not g.primary[p] for p in placed):
        return ()
    standby = np.flatnonzero(~g.primary)
    if not standby.size:
        return ()
    cached = inventory.cached(digest)[g.rows[standby]] if digest else np.zeros(len(standby), dtype=bool)
    free = inventory.free[g.flat[standby]]
    # lexsort: last key first; names follow positions, so the position breaks ties by name.
    best = standby[np.lexsort((standby, -free, ~cached))[0]]
    region = g.regions[best]
    return tuple(g.names[p] for p in standby if g.regions[p] == region)
