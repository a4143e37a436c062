"""Filter plugins: can this cluster run this deployment at all? Each returns None or the reason it can't.

Filters never look at free capacity (that changes as other deployments are placed; ``place`` turns it
into caps), so their verdict depends only on (rules, resource needs, cluster) and is cached per rules.
A NoSchedule taint is not a filter: the cluster keeps what it runs but receives nothing new (see
``place``); only NoExecute and unavailability make a cluster lose its replicas.

One filter depends on the deployment itself: `SpokePolicy`, a spoke's platform allow-lists (a spoke
refuses what they forbid). Its verdicts come precomputed with the deployment, so the filter is a lookup
and its results are cached per (rules, verdicts) like the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from embedfleet.operator.scheduling.model import Cluster
from embedfleet.operator.scheduling.policy import Rules

Filter = Callable[[Rules, bool, Cluster], str | None]


def health(rules: Rules, gpu: bool, cluster: Cluster) -> str | None:
    return None if cluster.available else "unavailable: lease expired beyond its grace period"


def region_lock(rules: Rules, gpu: bool, cluster: Cluster) -> str | None:
    if rules.regions and cluster.region not in rules.regions:
        return f"region {cluster.region} not in {sorted(rules.regions)}"
    return None


def residency(rules: Rules, gpu: bool, cluster: Cluster) -> str | None:
    missing = rules.residency - cluster.residency
    return f"missing residency labels {sorted(missing)}" if missing else None


def gpu_type(rules: Rules, gpu: bool, cluster: Cluster) -> str | None:
    if not gpu:
        return None if cluster.cpu_replicas > 0 else "no CPU replica capacity"
    wanted = rules.gpu_types or tuple(sorted({g.type for g in cluster.gpus}))
    if any(cluster.capacity(t) > 0 for t in wanted):
        return None
    return f"no GPUs of type {list(wanted)}" if rules.gpu_types else "no GPUs"


def taints(rules: Rules, gpu: bool, cluster: Cluster) -> str | None:
    for taint in cluster.taints:
        if taint.effect == "NoExecute" and not any(t.tolerates(taint) for t in rules.tolerations):
            return f"taint {taint.key}={taint.value}:NoExecute not tolerated"
    return None


#: How a SpokePolicy reason starts (after it, the spoke's first problem(s) with the spec).
REFUSED = "its platform policy refuses it: "


@dataclass(frozen=True, slots=True)
class SpokePolicy:
    """Keeps a deployment off spokes whose platform allow-lists forbid it (image, Secret reference,
    tolerations, node cache hostPath, control-plane targeting): such a spoke would only set
    ``Accepted=False`` on its copy and run nothing, while the replicas could have gone elsewhere.

    ``refused``: (policy key, why) pairs, sorted, from ``Deployment.refused``; hashable, so the filter
    cache keys on it and deployments refused the same way share one filter run.
    """

    refused: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, refused: Mapping[str, str]) -> SpokePolicy | None:
        """The filter for a deployment's verdicts; None when every spoke's policy accepts it."""
        return cls(tuple(sorted(refused.items()))) if refused else None

    def __call__(self, rules: Rules, gpu: bool, cluster: Cluster) -> str | None:
        for key, why in self.refused:
            if key == cluster.platform_policy:
                return REFUSED + why
        return None


#: Order matters only for which reason is reported: the cheapest and most fundamental first. Per-deployment
#: filters (SpokePolicy) run after these and before health, the one verdict that comes and goes by itself.
RULE_FILTERS: tuple[Filter, ...] = (region_lock, residency, gpu_type, taints)
FILTERS: tuple[Filter, ...] = (*RULE_FILTERS, health)


def run_filters(
    rules: Rules, gpu: bool, clusters: tuple[Cluster, ...], extra: tuple[Filter, ...] = ()
) -> tuple[list[Cluster], dict[str, str]]:
    """(clusters passing every filter, {cluster: first failing filter's reason})."""
    checks = (*RULE_FILTERS, *extra, health) if extra else FILTERS
    passed: list[Cluster] = []
    rejected: dict[str, str] = {}
    for cluster in clusters:
        for check in checks:
            reason = check(rules, gpu, cluster)
            if reason is not None:
                rejected[cluster.name] = reason
                break
        else:
            passed.append(cluster)
    return passed, rejected


def no_schedule(rules: Rules, cluster: Cluster) -> bool:
    """True when an untolerated NoSchedule taint lets the cluster keep, but not gain, replicas."""
    return any(
        t.effect == "NoSchedule" and not any(tol.tolerates(t) for tol in rules.tolerations) for t in cluster.taints
    )
