"""Placed (deployment, cluster) pairs, finished in one batch: their scores, range maxima and placements.

Scores only *order* candidates, so a deployment needs them only when something asks for the order (see
pipeline.py), and what a placed cluster's score and range max depend on is known when it is placed. So each
deployment records its placed pairs with those numbers (`Ledger.add`), and `Ledger.finish` works out every
pair's score and range at once, with array operations over all pairs, then makes one ``ClusterPlacement``
per pair: the per-pair work in Python is that object and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, islice

import numpy as np

from embedfleet.operator.scheduling.inventory import Costs, Group, Inventory
from embedfleet.operator.scheduling.model import ClusterPlacement, Deployment, ReplicaRange
from embedfleet.operator.scheduling.scores import Candidates, total


@dataclass(slots=True)
class Shares:
    """One deployment's placed clusters, waiting for their scores and range maxima: the dict to fill, and per
    placed cluster (division order, then spill and spread) its role and weight, and notes by position."""

    clusters: dict[str, ClusterPlacement]
    group: Group
    roles: Iterable[str]
    weights: Iterable[str]
    notes: dict[int, list[str]] | None
    max_replicas: int
    target: int
    divided: bool
    per_replica: int


class Ledger:
    """Every placed (deployment, cluster) pair, with what its score and its range max depend on as it was
    when the pair was placed; `finish` works them all out in one batch and fills in the placements, so
    that the per-pair work is array operations and one ``ClusterPlacement`` each.

    Per pair it keeps the cluster's position in its group, the replicas and what the pool had free before;
    the rest comes from the group, except where a deployment differs (`add`)."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.shares: list[Shares] = []
        self.size = 0
        self.counts: list[int] = []
        self.positions: list[np.ndarray] = []
        self.replicas: list[np.ndarray] = []
        self.free: list[np.ndarray] = []
        self.pools: list[tuple[int, np.ndarray]] = []
        self.limits: list[tuple[int, np.ndarray]] = []
        self.previous: list[tuple[int, np.ndarray]] = []
        self.cached: list[tuple[int, np.ndarray]] = []
        #: Per deployment: its candidates' cost figures (`Inventory.cost_of`, shared by deployments alike).
        self.costs: list[Costs] = []

    def add(
        self, shares: Shares, d: Deployment, placed: np.ndarray, replicas: np.ndarray, free: np.ndarray,
        previous: np.ndarray | None, pools: np.ndarray | None = None, limits: np.ndarray | None = None,
    ) -> None:
        """Record ``shares``: per placed position its replicas and what its pool had free before. Where they
        differ from the group's: the pools (a GPU type chosen per deployment) and the limits (other than the
        free capacity)."""
        if not len(placed):
            return
        self.shares.append(shares)
        self.counts.append(len(placed))
        self.positions.append(placed)
        self.replicas.append(replicas)
        self.free.append(free)
        if pools is not None:
            self.pools.append((self.size, pools))
        if limits is not None:
            self.limits.append((self.size, limits))
        if previous is not None:
            self.previous.append((self.size, previous[placed]))
        if d.digest is not None:
            self.cached.append((self.size, self.inventory.cached(d.digest)[shares.group.rows[placed]]))
        self.costs.append(self.inventory.cost_of(shares.group, d.model, shares.per_replica, d.spot_share))
        self.size += len(placed)

    def finish(self) -> None:
        """Score every recorded pair, work out its range, and fill in each deployment's clusters."""
        if not self.size:
            return
        shares, counts = self.shares, self.counts
        groups = list({id(s.group): s.group for s in shares}.values())
        # One index for any group's candidate: where its group starts among all groups' candidates, plus its
        # position in the group.
        starts = dict(zip(map(id, groups), np.cumsum([0, *map(len, groups)])[:-1].tolist(), strict=True))
        positions = np.concatenate(self.positions)
        at = self._each((starts[id(s.group)] for s in shares), np.int64) + positions
        price = np.concatenate([g.price for g in groups])[at]
        flat = _overlay(np.concatenate([g.flat for g in groups])[at], self.pools)
        free = np.concatenate(self.free)
        # The same for the cost figures: one index into all distinct `Costs` arrays laid end to end.
        tables = list({id(c): c for c in self.costs}.values())
        table_starts = dict(zip(map(id, tables), np.cumsum([0, *(len(c.value) for c in tables)])[:-1].tolist(),
                                strict=True))
        at_cost = self._each((table_starts[id(c)] for c in self.costs), np.int64) + positions
        cost = np.concatenate([c.value for c in tables])[at_cost]
        scores = total(Candidates(
            free, self.inventory.capacity[flat], cost, self._each((c.cheapest for c in self.costs), np.float64),
            self._each((c.dearest for c in self.costs), np.float64),
            _overlay(np.zeros(self.size, dtype=np.int64), self.previous),
            _overlay(np.zeros(self.size, dtype=bool), self.cached),
        ))
        replicas = np.concatenate(self.replicas)
        fits = free // self._each((s.per_replica for s in shares), np.int64)
        highs = range_max(
            replicas, fits, _overlay(fits.copy(), self.limits),
            self._each((s.max_replicas for s in shares), np.int64), self._each((s.target for s in shares), np.int64),
            self._each((s.divided for s in shares), bool),
        )
        # Equal ranges are one object (they are immutable): one per distinct (replicas, max).
        _, first, which = np.unique(replicas * (int(highs.max()) + 1) + highs, return_index=True, return_inverse=True)
        ranges = np.array([ReplicaRange(k, k, h) for k, h in zip(replicas[first].tolist(), highs[first].tolist(),
                                                                  strict=True)], dtype=object)
        notes: list[tuple[str, ...]] = [()] * self.size
        start = 0
        for s, n in zip(shares, counts, strict=True):
            if s.notes:
                for i, p in enumerate(positions[start : start + n].tolist(), start):
                    if p in s.notes:
                        notes[i] = tuple(s.notes[p])
            start += n
        names = np.array([name for g in groups for name in g.names], dtype=object)[at].tolist()
        regions = np.array([region for g in groups for region in g.region_of], dtype=object)[at].tolist()
        resources = np.array(self.inventory.resources, dtype=object)[flat % len(self.inventory.resources)].tolist()
        made = map(
            ClusterPlacement, ranges[which].tolist(), regions, resources, chain.from_iterable(s.roles for s in shares),
            scores.tolist(), price.tolist(), chain.from_iterable(s.weights for s in shares), notes,
            *((cost.tolist(), np.concatenate([c.measured for c in tables])[at_cost].tolist())
              if self.inventory.throughput is not None else ()),
        )
        by_name = iter(names)
        for s, n in zip(shares, counts, strict=True):
            s.clusters.update(zip(islice(by_name, n), islice(made, n), strict=True))

    def _each(self, values: Iterable[float], dtype: type) -> np.ndarray:
        """A per-deployment value, once for each of its pairs."""
        return np.repeat(np.fromiter(values, dtype=dtype, count=len(self.shares)), self.counts)


def _overlay(base: np.ndarray, parts: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """``base`` with each (start, values) written over it."""
    for start, values in parts:
        base[start : start + len(values)] = values
    return base


def range_max(
    k: np.ndarray, fits: np.ndarray, limit: np.ndarray, max_replicas: np.ndarray, target: np.ndarray,
    divided: np.ndarray,
) -> np.ndarray:
    """Range maxima: the spoke's autoscaler may grow to the deployment's max_replicas (its share of it, when
    divided), as far as the free capacity (``fits`` replicas before this deployment's) and the limit allow:
    max(k, min(ceiling, k + max(0, fits - k), max(limit, k)))."""
    share = np.where(target > 0, np.ceil(max_replicas * k / np.maximum(target, 1)), 0).astype(np.int64)
    ceiling = np.where(divided, share, max_replicas)
    return np.maximum(k, np.minimum(np.minimum(ceiling, k + np.maximum(0, fits - k)), np.maximum(limit, k)))
