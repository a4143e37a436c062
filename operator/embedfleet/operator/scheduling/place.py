"""``place()``: every deployment's per-cluster replica ranges, from inventory and policies. Pure.

For each deployment, in key order (deterministic; earlier ones see more free capacity):

1. policy   resolve the applicable PlacementPolicy; a contradicting inline field rejects the deployment.
2. filter   health, region lock, residency, GPU type, NoExecute taints, the spoke's platform policy
            (once per rules and policy verdicts: `inventory.Group`). When replicas stay unplaced, the spokes
            whose policy refuses the deployment are named among its problems (the hub's ``Placed=False``
            message).
3. caps     free capacity of the chosen resource pool, per-cluster max, NoSchedule (keep, don't grow),
            and the *return ramp*: a cluster that came back less than ``ramp_seconds`` ago may grow only to
            ``max(previous, ceil(fraction_elapsed * fair share))``; what it may not take yet stays where it
            runs now (gradual move back, no thundering herd, healthy replicas kept until then).
4. score    order candidates: the points of the plugins in ``scores.SCORES`` (free capacity, cost per
            million embeddings (cost.py), stickiness, cached weights), added up.
5. select   ActiveActive/RegionLocked: all candidates (or the best ``maxClusters``, regions first);
            ActivePassive: candidates in the primary regions, else the best-scoring standby region; while
            the primary regions serve, the standby region is named to keep the weights warm (warm.py).
6. divide   Duplicated (each selected cluster runs the target) or Divided (by weight, floors first).
7. spill    what the caps left unplaced goes to other candidates: first those already running it, then by
            score. Filters are never relaxed, so a region lock holds during failover too.
8. spread   ActiveActive moves single replicas so at least ``minRegions`` regions run one, while that
            many regions have room.

Failover needs no special case: an unavailable cluster fails the health filter, so its share is divided
over the remaining allowed clusters by the same rules, in the same call.

Speed (bench/scheduler.py): a deployment's candidates are arrays, one entry per cluster in name order
(inventory.py), so a step is a numpy operation, not a loop over clusters; filters run once per distinct
rules. The common case, an even split that nothing but free capacity caps, takes a shortcut (even.py) to
what the full pipeline (pipeline.py) decides. Scores only order candidates, so a deployment is scored only
when something needs the order; the scores and range maxima reported for placed clusters are worked out
for all deployments in one batch at the end (shares.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from operator import attrgetter

from embedfleet.operator.scheduling.cost import Throughput
from embedfleet.operator.scheduling.even import decide_even
from embedfleet.operator.scheduling.filters import SpokePolicy
from embedfleet.operator.scheduling.inventory import Group, Inventory
from embedfleet.operator.scheduling.model import Cluster, Deployment, Placement, Policy
from embedfleet.operator.scheduling.pipeline import decide
from embedfleet.operator.scheduling.policy import Rules, resolve
from embedfleet.operator.scheduling.shares import Ledger
from embedfleet.operator.scheduling.warm import warm_standby

DEFAULT_RAMP_SECONDS = 60.0
#: Nothing measured yet: every cost rests on the prior.
NO_MEASUREMENTS = Throughput()


def _refusals(
    spoke: SpokePolicy, rules: Rules, gpu: bool, inventory: tuple[Cluster, ...], rejected: Mapping[str, str]
) -> list[str]:
    """``<cluster>: <why its policy refuses it>`` for each cluster left out for that reason (not for one an
    earlier filter already excluded); only worked out for a deployment that is short."""
    out = []
    for cluster in inventory:
        reason = rejected.get(cluster.name)
        if reason is not None and reason == spoke(rules, gpu, cluster):
            out.append(f"{cluster.name}: {reason}")
    return out


def place(
    deployments: Iterable[Deployment],
    clusters: Iterable[Cluster],
    policies: Sequence[Policy] = (),
    now: float = 0.0,
    *,
    ramp_seconds: float = DEFAULT_RAMP_SECONDS,
    throughput: Throughput | None = NO_MEASUREMENTS,
) -> dict[str, Placement]:
    """Deployment key -> Placement. Same inputs, same output; see the module docstring for the pipeline.

    ``throughput``: the embeddings per second the fleet measured per (model, resource) (learn.py); the price
    score ranks candidates by cost per million embeddings from it, and from the size-based prior where
    nothing was measured (cost.py). None ranks by hourly price alone (bench/placement_cost.py compares)."""
    with _collector_paused():
        return _place(deployments, clusters, policies, now, ramp_seconds, throughput)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector for one ``place`` call. The call builds one object per placed
    (deployment, cluster) pair (two million for 100,000 deployments over 1,000 clusters), none of them in a
    reference cycle; as they pile up the collector would walk every live object again and again, for about
    half of the run time at that size. Reference counting still frees everything as usual; the collector is
    switched back on afterwards (unless it was already off), and finds any cycle then."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _price_spot(inventory: Inventory, spot_deployments: Iterable[Deployment], result: dict[str, Placement]) -> None:
    """Where a placed cluster prices a spot pool for its resource, its reported price is the deployment's
    mix (what `Inventory.cost_of` ranked it by) and ``spot`` says the share; the cost already is the mix."""
    assert inventory.spot_price is not None
    width = len(inventory.resources)
    for d in spot_deployments:
        for name, share in result[d.key].clusters.items():
            spot = inventory.spot_price[inventory.row[name] * width + inventory.column[share.resource]]
            if spot == spot:  # not NaN: this pool has spot nodes
                share.price = (1.0 - d.spot_share) * share.price + d.spot_share * float(spot)
                share.spot = d.spot_share


def _place(
    deployments: Iterable[Deployment], clusters: Iterable[Cluster], policies: Sequence[Policy], now: float,
    ramp_seconds: float, throughput: Throughput | None,
) -> dict[str, Placement]:
    inventory = Inventory.of(tuple(sorted(clusters, key=attrgetter("name"))), now, ramp_seconds, throughput)
    ledger = Ledger(inventory)
    groups: dict[tuple[Rules, bool, SpokePolicy | None], Group] = {}
    # (intent, namespace labels, GPU type, GPU or CPU, spoke verdicts) -> (rules, policy, problems, group):
    # deployments that ask for the same are resolved and filtered once.
    known: dict[tuple[object, ...], tuple[Rules | None, str | None, list[str], Group | None]] = {}
    result: dict[str, Placement] = {}
    passive: list[tuple[Deployment, Group]] = []
    deployments_sorted = sorted(deployments, key=attrgetter("key"))
    for d in deployments_sorted:
        gpu = d.gpus_per_replica > 0
        spoke = SpokePolicy.of(d.refused)
        key = (d.intent, d.namespace_labels, d.gpu_type, gpu, spoke)
        entry = known.get(key)
        if entry is None:
            rules, policy_name, problems = resolve(d.intent, policies, dict(d.namespace_labels), d.gpu_type)
            group = None
            if rules is not None:
                group = groups.get((rules, gpu, spoke))
                if group is None:
                    group = groups[(rules, gpu, spoke)] = Group.of(rules, gpu, inventory, (spoke,) if spoke else ())
            entry = known[key] = (rules, policy_name, problems, group)
        rules, policy_name, problems, group = entry
        if rules is None or group is None:
            result[d.key] = Placement({}, {}, False, policy_name, problems=tuple(problems))
            continue
        decided = (decide_even(d, group, inventory, ledger) if group.plain else None) or decide(
            d, group, inventory, ramp_seconds, ledger)
        chosen, filtered, target, problems, placed = decided
        if spoke is not None and (problems or placed < target):
            problems += _refusals(spoke, rules, gpu, inventory.clusters, group.rejected)
        result[d.key] = Placement(chosen, filtered, True, policy_name, rules.mode, target, tuple(problems))
        if rules.mode == "ActivePassive":
            passive.append((d, group))
    ledger.finish()
    if inventory.spot_price is not None:
        _price_spot(inventory, [d for d in deployments_sorted if d.spot_share > 0], result)
    for d, group in passive:  # after every placement: the free capacity a failover would find
        placement = result[d.key]
        placement.warm = warm_standby(placement, group, inventory, d.digest)
    return result
