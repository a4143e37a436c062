"""Merge a deployment's inline placement with the platform's PlacementPolicy; reject contradictions.

The highest-priority PlacementPolicy whose namespace selector matches the deployment's namespace applies
(ties: the name sorting first). A policy is a set of *constraints* plus defaults: inline fields may
narrow it (fewer regions, more residency labels, more regions to spread over) but never widen it. An
inline field that contradicts the policy makes the deployment rejected, with one sentence per conflict,
instead of silently overriding either side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from embedfleet.operator.scheduling.model import Division, Intent, Mode, Policy, Toleration


@dataclass(frozen=True, slots=True)
class Rules:
    """The effective placement rules of one deployment (hashable: filter results are cached by it)."""

    mode: Mode = "ActiveActive"
    regions: frozenset[str] = frozenset()
    residency: frozenset[str] = frozenset()
    min_regions: int = 1
    primary_regions: tuple[str, ...] = ()
    gpu_types: tuple[str, ...] = ()
    division: Division = "Divided"
    weights: tuple[tuple[str, int], ...] = ()
    cluster_limits: tuple[tuple[str, int, int | None], ...] = ()
    max_replicas_per_cluster: int | None = None
    max_clusters: int | None = None
    tolerations: tuple[Toleration, ...] = ()


def select_policy(policies: Sequence[Policy], namespace_labels: Mapping[str, str]) -> Policy | None:
    matching = [p for p in policies if p.matches(namespace_labels)]
    if not matching:
        return None
    return min(matching, key=lambda p: (-p.priority, p.name))


def _shape_problems(intent: Intent, where: str) -> list[str]:
    problems = []
    if intent.mode == "RegionLocked" and not intent.regions and not intent.residency:
        problems.append(f"{where}: mode RegionLocked needs regions or residency labels")
    if intent.mode == "ActivePassive" and not intent.primary_regions:
        problems.append(f"{where}: mode ActivePassive needs primaryRegions")
    if intent.regions and intent.primary_regions:
        outside = sorted(set(intent.primary_regions) - set(intent.regions))
        if outside:
            problems.append(f"{where}: primaryRegions {outside} are not among regions {sorted(intent.regions)}")
    for cluster, low, high in intent.cluster_limits:
        if high is not None and low > high:
            problems.append(f"{where}: clusterLimits[{cluster}] minReplicas {low} > maxReplicas {high}")
    return problems


def conflicts(inline: Intent, policy: Policy) -> list[str]:
    """Sentences naming each inline field that contradicts ``policy`` (empty: compatible)."""
    rule = policy.intent
    name = f"PlacementPolicy {policy.name}"
    out = []
    if rule.mode is not None and inline.mode is not None and inline.mode != rule.mode:
        out.append(f"spec.placement.mode {inline.mode} contradicts {name} (mode {rule.mode})")
    if rule.regions and inline.regions:
        outside = sorted(set(inline.regions) - set(rule.regions))
        if outside:
            out.append(f"spec.placement.regions {outside} are outside {name} (regions {sorted(rule.regions)})")
    if rule.min_regions is not None and inline.min_regions is not None and inline.min_regions < rule.min_regions:
        out.append(f"spec.placement.minRegions {inline.min_regions} is below {name} (minRegions {rule.min_regions})")
    if rule.gpu_types and inline.gpu_types:
        outside = sorted(set(inline.gpu_types) - set(rule.gpu_types))
        if outside:
            out.append(f"spec.placement.gpuTypes {outside} are not allowed by {name} ({sorted(rule.gpu_types)})")
    if rule.division is not None and inline.division is not None and inline.division != rule.division:
        out.append(f"spec.placement.policy {inline.division} contradicts {name} (policy {rule.division})")
    cap = rule.max_replicas_per_cluster
    if cap is not None:
        if inline.max_replicas_per_cluster is not None and inline.max_replicas_per_cluster > cap:
            out.append(
                f"spec.placement.maxReplicasPerCluster {inline.max_replicas_per_cluster} exceeds {name} ({cap})"
            )
        for cluster, low, _ in inline.cluster_limits:
            if low > cap:
                out.append(f"spec.placement.clusterLimits[{cluster}].minReplicas {low} exceeds {name} ({cap})")
    return out


def resolve(
    inline: Intent, policies: Sequence[Policy], namespace_labels: Mapping[str, str], gpu_type: str | None
) -> tuple[Rules | None, str | None, list[str]]:
    """(effective rules or None when rejected, the policy's name, problems)."""
    policy = select_policy(policies, namespace_labels)
    problems = _shape_problems(inline, "spec.placement")
    rule = policy.intent if policy is not None else Intent()
    if policy is not None:
        problems += conflicts(inline, policy)
    if problems:
        return None, policy.name if policy else None, problems

    mode: Mode = inline.mode or rule.mode or "ActiveActive"
    regions = frozenset(inline.regions or rule.regions)
    residency = frozenset(inline.residency) | frozenset(rule.residency)
    gpu_types = inline.gpu_types or rule.gpu_types
    if not gpu_types and gpu_type:
        gpu_types = (gpu_type,)
    if rule.gpu_types and gpu_type and not inline.gpu_types and gpu_type not in rule.gpu_types:
        name = policy.name if policy else ""
        return None, name, [f"spec.runtime.gpu.type {gpu_type} is not allowed by PlacementPolicy {name}"]
    min_regions = max(inline.min_regions or 1, rule.min_regions or 1)
    caps = [c for c in (inline.max_replicas_per_cluster, rule.max_replicas_per_cluster) if c is not None]
    primary = inline.primary_regions or rule.primary_regions
    rules = Rules(
        mode=mode,
        regions=regions,
        residency=residency,
        min_regions=min_regions if mode == "ActiveActive" else 1,
        primary_regions=tuple(primary),
        gpu_types=tuple(gpu_types),
        division=inline.division or rule.division or "Divided",
        weights=inline.weights or rule.weights,
        cluster_limits=inline.cluster_limits or rule.cluster_limits,
        max_replicas_per_cluster=min(caps) if caps else None,
        max_clusters=inline.max_clusters or rule.max_clusters,
        tolerations=inline.tolerations + rule.tolerations,
    )
    if mode == "ActivePassive" and not rules.primary_regions:
        return None, policy.name if policy else None, ["mode ActivePassive needs primaryRegions"]
    if mode == "RegionLocked" and not rules.regions and not rules.residency:
        return None, policy.name if policy else None, ["mode RegionLocked needs regions or residency labels"]
    return rules, policy.name if policy else None, []
