"""What ``place`` works out once per call, so that placing one deployment is a few array operations.

`Inventory`: the clusters in name order and every capacity pool as one flat array (row = cluster, column =
CPU or a GPU type), which ``place`` draws down deployment by deployment. `Group`: the candidates of one
(rules, GPU or CPU, spoke-policy verdicts) key: which clusters pass the filters (the filters run once per
key) and everything about them that does not change while deployments are placed: the pool each draws
from, prices, static caps, regions. Positions in a group follow the inventory, hence cluster-name order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from embedfleet.operator.scheduling.cost import Throughput, cost_array
from embedfleet.operator.scheduling.filters import Filter, no_schedule, run_filters
from embedfleet.operator.scheduling.model import CPU, Cluster
from embedfleet.operator.scheduling.policy import Rules

#: A cap that never binds (an int64, so caps stay integer arrays).
UNCAPPED = np.iinfo(np.int64).max


@dataclass(frozen=True, slots=True)
class Inventory:
    """The clusters of one ``place`` call. ``free`` is the only thing that changes while it runs."""

    clusters: tuple[Cluster, ...]
    #: Cluster name -> row.
    row: dict[str, int]
    #: Pool names, one column each: CPU first, then every GPU type in the fleet, sorted.
    resources: tuple[str, ...]
    column: dict[str, int]
    #: Pool sizes, flat: cluster row * len(resources) + column.
    capacity: np.ndarray
    #: Hourly price of one unit of each pool, same layout (``Cluster.price``).
    price: np.ndarray
    #: Units still free per pool, same layout; ``place`` subtracts what each deployment takes.
    free: np.ndarray
    #: Per cluster, how far along its return ramp it is (1.0: not returning).
    ramp: tuple[float, ...]
    #: Weights digest -> per cluster, is it cached there (filled as digests come up).
    digests: dict[str, np.ndarray]
    #: Measured throughput for the cost ranking (None: rank by hourly price alone).
    throughput: Throughput | None = None
    #: (group id, model, units per replica, spot share) -> its candidates' `Costs` (filled as they come up).
    costs: dict[tuple[int, str, int, float], Costs] | None = None
    #: Hourly price of one unit on each pool's spot nodes, same layout; NaN where none is declared (None: no
    #: cluster declares one, the common case, which then costs nothing more).
    spot_price: np.ndarray | None = None

    @classmethod
    def of(cls, clusters: tuple[Cluster, ...], now: float, ramp_seconds: float,
           throughput: Throughput | None = None) -> Inventory:
        """``clusters`` sorted by name; ``now`` and ``ramp_seconds`` place each on its return ramp;
        ``throughput``: what the fleet measured, for ranking by cost per embedding (None: by hourly price)."""
        resources = (CPU, *sorted({g.type for c in clusters for g in c.gpus} - {CPU}))
        column = {r: j for j, r in enumerate(resources)}
        capacity = np.zeros((len(clusters), len(resources)), dtype=np.int64)
        price = np.zeros((len(clusters), len(resources)))
        spot = np.full((len(clusters), len(resources)), np.nan)
        for i, c in enumerate(clusters):
            for t in {g.type for g in c.gpus if g.spot_hourly_price is not None} - {CPU}:
                spot[i, column[t]] = c.spot_price(t)
            if c.cpu_spot_hourly_price is not None:
                spot[i, 0] = c.cpu_spot_hourly_price
            for g in c.gpus:
                if g.type != CPU:
                    capacity[i, column[g.type]] += g.count
            for t in {g.type for g in c.gpus} - {CPU}:
                price[i, column[t]] = c.price(t)
            capacity[i, 0] = c.cpu_replicas
            price[i, 0] = c.cpu_hourly_price
        ramp = tuple(_ramp_fraction(c, now, ramp_seconds) for c in clusters)
        return cls(clusters, {c.name: i for i, c in enumerate(clusters)}, resources, column, capacity.ravel(),
                   price.ravel(), capacity.ravel().copy(), ramp, {}, throughput, {},
                   spot.ravel() if not np.isnan(spot).all() else None)

    def cached(self, digest: str) -> np.ndarray:
        """Per cluster: does it report these weights cached?"""
        where = self.digests.get(digest)
        if where is None:
            where = self.digests[digest] = np.array([digest in c.cached_digests for c in self.clusters], dtype=bool)
        return where


    def prices(self, g: Group, spot_share: float) -> np.ndarray:
        """Hourly price per unit of ``g``'s candidates for a deployment that may run ``spot_share`` of its
        replicas on spot: that mix of the spot and on-demand prices where a spot pool is priced, else the
        on-demand price."""
        if spot_share <= 0 or self.spot_price is None or not len(g):
            return g.price
        spot = self.spot_price[g.flat]
        return np.where(np.isnan(spot), g.price, (1.0 - spot_share) * g.price + spot_share * spot)

    def cost_of(self, g: Group, model: str, per_replica: int, spot_share: float = 0.0) -> Costs:
        """What ranks ``g``'s candidates for a deployment of ``model`` needing ``per_replica`` units: dollars
        per million embeddings of each candidate's pool (its hourly price without a cost ranking), once
        per (group, model, units). A candidate allowed several GPU types is costed at its cheapest price
        and its first present type's rate (the pool it draws from is chosen per deployment). With
        ``spot_share``, at the mix `prices` gives."""
        spot_share = spot_share if self.spot_price is not None else 0.0
        key = (id(g), model, per_replica, spot_share)
        costs = self.costs
        assert costs is not None
        found = costs.get(key)
        if found is None:
            price = self.prices(g, spot_share)
            if self.throughput is None or not len(g):
                value, measured = price, np.zeros(len(g), dtype=bool)
            else:
                rates, known = self.throughput.unit_rates(model, per_replica, self.resources)
                columns = g.flat % len(self.resources)
                value, measured = cost_array(price, rates[columns]), known[columns]
            finite = value[np.isfinite(value)]
            found = costs[key] = Costs(value, measured, float(finite.min()) if len(finite) else 0.0,
                                       float(finite.max()) if len(finite) else 0.0)
        return found


@dataclass(frozen=True, slots=True)
class Costs:
    """One deployment's ranking figure per candidate (cost per million embeddings, or hourly price), whether
    it was measured, and its lowest and highest finite value."""

    value: np.ndarray
    measured: np.ndarray
    cheapest: float
    dearest: float


def _ramp_fraction(cluster: Cluster, now: float, ramp_seconds: float) -> float:
    if cluster.available_since is None or ramp_seconds <= 0:
        return 1.0
    return max(0.0, min(1.0, (now - cluster.available_since) / ramp_seconds))


@dataclass(frozen=True, slots=True)
class Group:
    """The candidates of one (rules, GPU or CPU, spoke verdicts) key; arrays hold one entry per candidate."""

    rules: Rules
    #: Why each other cluster failed a filter (cluster -> first failing filter's reason).
    rejected: dict[str, str]
    names: tuple[str, ...]
    position: dict[str, int]
    region_of: tuple[str, ...]
    #: Row of each candidate in the inventory.
    rows: np.ndarray
    #: Region of each candidate as a small integer (equal regions, equal ids), as an array and as a tuple.
    regions: np.ndarray
    region_ids: tuple[int, ...]
    #: Index of each candidate's pool in ``Inventory.free`` (for `choices`, of its first present type).
    flat: np.ndarray
    #: That pool's size.
    capacity: np.ndarray
    #: Candidates allowed several GPU types, as (position, columns of the types present, in rule order): the
    #: first with room for one replica is taken, deployment by deployment.
    choices: tuple[tuple[int, tuple[int, ...]], ...]
    #: Hourly price of one unit of each candidate's pool (`Inventory.cost_of` turns it into a cost).
    price: np.ndarray
    #: clusterLimits max and maxReplicasPerCluster, the lower of the two (None: no candidate has one).
    limit: np.ndarray | None
    #: Untolerated NoSchedule taint: keeps what it runs, gains nothing (None: no candidate has one).
    no_schedule: np.ndarray | None
    #: (position, ramp fraction) of candidates still on their return ramp.
    ramping: tuple[tuple[int, float], ...]
    #: clusterLimits floors by position.
    floors: Mapping[int, int]
    #: spec.placement.weights per candidate, as the division weighs them (1 where unnamed); None without weights.
    weights: np.ndarray | None
    #: Named with a weight above 0 (only those are selected, except by ActivePassive); None without weights.
    weighted: np.ndarray | None
    #: Candidates in a primary region (ActivePassive), as a mask, as positions and as their pools.
    primary: np.ndarray
    primary_at: np.ndarray
    primary_flat: np.ndarray
    #: Positions 0..n-1 twice over: a division order rotated by k is ``twice[k:k + n]``, with no copy; the
    #: same for the primary candidates.
    twice: np.ndarray
    primary_twice: np.ndarray
    #: Constant arrays, shared (never written to): no previous replicas anywhere, weights cached nowhere,
    #: one replica each, equal weights.
    zeros: np.ndarray
    nowhere: np.ndarray
    unit: np.ndarray
    ones: np.ndarray
    #: Nothing but free capacity caps a candidate (no limits, taints, ramps, floors, weights, GPU choice,
    #: maxClusters cut) and the total is divided: ``place`` may take its even-split shortcut.
    plain: bool
    #: ``filtered`` maps shared by the deployments that leave out the same candidates (by why they did).
    left_out: dict[str, dict[str, str]]

    def __len__(self) -> int:
        return len(self.names)

    @classmethod
    def of(cls, rules: Rules, gpu: bool, inventory: Inventory, extra: tuple[Filter, ...]) -> Group:
        """Run the filters (``extra``: the deployment-specific ones) and lay out what passes."""
        passed, rejected = run_filters(rules, gpu, inventory.clusters, extra)
        width = len(inventory.resources)
        n = len(passed)
        names = tuple(c.name for c in passed)
        region_of = tuple(c.region for c in passed)
        rows = np.array([inventory.row[name] for name in names], dtype=np.int64)
        columns = np.zeros(n, dtype=np.int64)
        choices, several = [], []
        if gpu:
            for p, (c, row) in enumerate(zip(passed, rows.tolist(), strict=True)):
                types = rules.gpu_types or tuple(sorted({g.type for g in c.gpus}))
                present = tuple(j for t in types
                                if (j := inventory.column.get(t, 0)) and inventory.capacity[row * width + j] > 0)
                columns[p] = present[0] if present else 0
                if len(present) != 1:
                    # Several allowed types (none never gets past the GPU filter): the pool is chosen per
                    # deployment, the price is the cluster's cheapest GPU.
                    several.append(p)
                    if present:
                        choices.append((p, present))
        flat = rows * width + columns
        price = inventory.price[flat]
        for p in several:
            price[p] = min(g.hourly_price for g in passed[p].gpus)
        maxes = {name: high for name, _, high in rules.cluster_limits if high is not None}
        cap_all = rules.max_replicas_per_cluster
        limit = None
        if maxes or cap_all is not None:
            limit = np.array([min(maxes.get(name, UNCAPPED), UNCAPPED if cap_all is None else cap_all)
                              for name in names], dtype=np.int64)
        tainted = [bool(c.taints) and no_schedule(rules, c) for c in passed]
        region_id: dict[str, int] = {}
        region_ids = tuple(region_id.setdefault(r, len(region_id)) for r in region_of)
        ramping = tuple((p, f) for p, i in enumerate(rows.tolist()) if (f := inventory.ramp[i]) < 1.0)
        weights = dict(rules.weights)
        floors = {name: low for name, low, _ in rules.cluster_limits if low > 0}
        primary = np.array([c.region in rules.primary_regions for c in passed], dtype=bool)
        primary_at = np.flatnonzero(primary)
        plain = not (limit is not None or any(tainted) or ramping or floors or choices or weights
                     or rules.division != "Divided" or (rules.max_clusters is not None and rules.max_clusters < n))
        return cls(
            rules=rules,
            rejected=rejected,
            names=names,
            position={name: p for p, name in enumerate(names)},
            region_of=region_of,
            rows=rows,
            regions=np.array(region_ids, dtype=np.int64),
            region_ids=region_ids,
            flat=flat,
            capacity=inventory.capacity[flat],
            choices=tuple(choices),
            price=price,
            limit=limit,
            no_schedule=np.array(tainted, dtype=bool) if any(tainted) else None,
            ramping=ramping,
            floors={p: floors[name] for p, name in enumerate(names) if name in floors},
            weights=np.array([float(weights.get(name, 1)) for name in names]) if weights else None,
            weighted=np.array([weights.get(name, 0) > 0 for name in names], dtype=bool) if weights else None,
            primary=primary,
            primary_at=primary_at,
            primary_flat=flat[primary_at],
            twice=np.concatenate((np.arange(n), np.arange(n))),
            primary_twice=np.concatenate((primary_at, primary_at)),
            zeros=np.zeros(n, dtype=np.int64),
            nowhere=np.zeros(n, dtype=bool),
            unit=np.ones(n, dtype=np.int64),
            ones=np.ones(n),
            plain=plain,
            left_out={},
        )

    def pools(self, inventory: Inventory, per_replica: int) -> tuple[np.ndarray, np.ndarray]:
        """(index in ``Inventory.free``, pool size) per candidate, for a deployment needing ``per_replica``
        units: a candidate with several allowed GPU types draws from the first with room for one replica,
        else the first present."""
        if not self.choices:
            return self.flat, self.capacity
        width = len(inventory.resources)
        flat = self.flat.copy()
        for p, present in self.choices:
            base = int(self.rows[p]) * width
            flat[p] = base + next((j for j in present if inventory.free[base + j] >= per_replica), present[0])
        return flat, inventory.capacity[flat]

    def previous(self, previous: Mapping[str, int]) -> np.ndarray:
        """A deployment's previous replicas per candidate."""
        out = self.zeros.copy()
        for name, k in previous.items():
            p = self.position.get(name)
            if p is not None:
                out[p] = k
        return out
