"""What the node agent should hold on its node, and what to do about it. Pure: no I/O, no clock.

Three decisions, each a function of what was read (so property tests can feed them anything):

* `wanted_entries`: the (namespace, digest, source) this node should cache, from every
  EmbeddingDeployment with ``spec.cache.prePull`` and every ModelCache whose spec is valid (the same
  checks the operator runs, the platform's allow-lists included) and whose node pools select this node;
  nothing on a control-plane node unless the platform allows it;
* `plan`: which entries to pull, which to delete (an entry nobody wants is kept ``retention`` seconds
  after it became unwanted, so a deployment re-created a minute later finds its weights), and the
  new memory of when each entry became unwanted;
* `wanted_engines`: the tenants' engines folders this node should keep (deployments with pre-pull whose
  runtime builds an engine: `prepull.shares_engine_builds`), retired by the same `plan`;
* `label_patch`: the merge patch that makes the node's ``cache.embedfleet.dev/*`` labels say exactly
  "this tenant's weights are ready here" for each wanted entry that is ready on disk, and nothing else.

The ModelCache handler counts nodes with `node_selected` too, so "cachedNodes/totalNodes" means the
same nodes the agent serves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, NodePool
from embedfleet.operator.crd.prepull import node_pools, pull_source, shares_engine_builds
from embedfleet.operator.platform import CONTROL_PLANE_LABELS, PlatformPolicy
from embedfleet.operator.validate import check, check_model_cache

#: Directory names in the cache root that are cache entries: ``<namespace>_sha256-<64 hex>``, and the
#: pre-tenant layout ``sha256-<64 hex>`` (left by older pullers; never wanted, so retired like any other).
ENTRY_NAME = re.compile(r"^(?:[a-z0-9]([-a-z0-9]*[a-z0-9])?_)?sha256-[0-9a-f]{64}$")
#: A tenant's engines folder: ``<namespace>_engines-sha256-<64 hex>`` (operator/cache/engines.py).
ENGINES_NAME = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?_engines-sha256-[0-9a-f]{64}$")


@dataclass(frozen=True, order=True)
class Want:
    """One cache entry this node should hold."""

    namespace: str
    digest: str
    source: str  # as `embedfleet cache pull --source` takes it (hf:// with @revision)

    @property
    def entry(self) -> str:
        return naming.cache_entry(self.namespace, self.digest)

    @property
    def label(self) -> str:
        return naming.cache_label_key(self.digest, self.namespace)

    @property
    def engines(self) -> str:
        return naming.engines_entry(self.namespace, self.digest)


def is_control_plane(node_labels: Mapping[str, str]) -> bool:
    return any(key in node_labels for key in CONTROL_PLANE_LABELS)


def node_selected(
    node_labels: Mapping[str, str],
    selector: Mapping[str, str],
    pools: Iterable[NodePool],
    allow_control_plane: bool,
) -> bool:
    """Whether some pool's selector is a subset of the node's labels (and the node may be used at all)."""
    if is_control_plane(node_labels) and not allow_control_plane:
        return False
    return any(
        all(node_labels.get(k) == v for k, v in pool.node_selector.items())
        for pool in node_pools(dict(selector), list(pools))
    )


def _meta(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    meta = obj.get("metadata") or {}
    if meta.get("deletionTimestamp") or not meta.get("name") or not meta.get("namespace"):
        return None
    return meta["name"], meta["namespace"]


def wanted_entries(
    node_labels: Mapping[str, str],
    deployments: Iterable[Mapping[str, Any]],
    caches: Iterable[Mapping[str, Any]],
    policy: PlatformPolicy,
) -> dict[str, Want]:
    """Entry name -> what to hold there. Objects being deleted, invalid specs and specs the platform
    refuses want nothing (the operator creates nothing for them either). Two objects of one namespace
    asking for the same digest share one entry (the digest decides the bytes; the smallest source wins,
    so the choice does not depend on list order)."""
    if is_control_plane(node_labels) and not policy.allow_control_plane:
        return {}
    found: dict[str, Want] = {}

    def add(want: Want) -> None:
        if want.entry not in found or want < found[want.entry]:
            found[want.entry] = want

    for namespace, spec in _pre_pulled(node_labels, deployments, policy):
        assert spec.model.digest is not None
        add(Want(namespace, spec.model.digest, pull_source(spec.model)))
    for obj in caches:
        ident = _meta(obj)
        raw = obj.get("spec")
        if ident is None or not isinstance(raw, Mapping):
            continue
        mc, _ = check_model_cache(ident[0], raw, policy)
        if mc is None or mc.model.digest is None:
            continue
        if node_selected(node_labels, mc.node_selector, mc.node_pools, policy.allow_control_plane):
            add(Want(ident[1], mc.model.digest, pull_source(mc.model)))
    return found


def _pre_pulled(node_labels: Mapping[str, str], deployments: Iterable[Mapping[str, Any]],
                policy: PlatformPolicy) -> Iterable[tuple[str, EmbeddingDeploymentSpec]]:
    """(namespace, checked spec) of every deployment with pre-pull whose pools select this node."""
    for obj in deployments:
        ident = _meta(obj)
        raw = obj.get("spec")
        if ident is None or not isinstance(raw, Mapping) or not (raw.get("cache") or {}).get("prePull"):
            continue
        spec, _ = check(ident[0], raw, policy)
        if spec is None or spec.model.digest is None:
            continue
        cache = spec.cache
        if node_selected(node_labels, cache.node_selector, cache.node_pools, policy.allow_control_plane):
            yield ident[1], spec


def wanted_engines(
    node_labels: Mapping[str, str], deployments: Iterable[Mapping[str, Any]], policy: PlatformPolicy
) -> dict[str, Want]:
    """Engines folder name -> the weights it belongs to, for every deployment this node pre-pulls whose
    runtime builds an engine (the same ones the renderer mounts the folder for)."""
    if is_control_plane(node_labels) and not policy.allow_control_plane:
        return {}
    found: dict[str, Want] = {}
    for namespace, spec in _pre_pulled(node_labels, deployments, policy):
        if shares_engine_builds(spec):
            assert spec.model.digest is not None
            want = Want(namespace, spec.model.digest, pull_source(spec.model))
            if want.engines not in found or want < found[want.engines]:
                found[want.engines] = want
    return found


@dataclass(frozen=True)
class Plan:
    pull: list[Want] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    #: Entry -> when it became unwanted (what the agent remembers for the next pass).
    unwanted_since: dict[str, float] = field(default_factory=dict)


def plan(
    wanted: Mapping[str, Want],
    on_disk: Mapping[str, bool],
    unwanted_since: Mapping[str, float],
    now: float,
    retention: float,
) -> Plan:
    """``on_disk``: entry name -> whether it is ready. Wanted entries not ready are pulled; entries on
    disk nobody wants are deleted once unwanted for ``retention`` seconds (the clock starts at the first
    pass that finds them unwanted); entries that are gone are forgotten."""
    to_pull = sorted(w for name, w in wanted.items() if not on_disk.get(name, False))
    memory: dict[str, float] = {}
    delete: list[str] = []
    for name in sorted(on_disk):
        if name in wanted:
            continue
        since = unwanted_since.get(name, now)
        if now - since >= retention:
            delete.append(name)
        else:
            memory[name] = since
    return Plan(pull=to_pull, delete=delete, unwanted_since=memory)


def label_patch(
    wanted: Mapping[str, Want], ready: Iterable[str], node_labels: Mapping[str, str],
    engine_labels: Iterable[str] = (),
) -> dict[str, str | None]:
    """Merge-patch labels (None removes one): ``<cache label>=ready`` for every wanted entry that is ready
    on disk and for each of ``engine_labels`` (the engine builds held: `naming.engine_label_key`); every
    other ``cache.embedfleet.dev/`` label goes, whoever wrote it. Empty when the node is already right
    (steady state writes nothing)."""
    ready_names = set(ready)
    desired = {w.label: naming.CACHE_LABEL_READY for name, w in wanted.items() if name in ready_names}
    desired.update({key: naming.CACHE_LABEL_READY for key in engine_labels})
    patch: dict[str, str | None] = {
        key: value for key, value in desired.items() if node_labels.get(key) != value
    }
    for key in node_labels:
        if key.startswith(naming.CACHE_LABEL_PREFIX) and key not in desired:
            patch[key] = None
    return patch


def cache_node_counts(
    nodes: Iterable[Mapping[str, Any]],
    namespace: str,
    digest: str,
    selector: Mapping[str, str],
    pools: Iterable[NodePool],
    allow_control_plane: bool,
) -> tuple[int, int]:
    """(nodes labelled ready for this tenant's digest, nodes the pools select): a cache's status, from the
    same selection rule the agent applies, so "3/4" counts the nodes the agent serves."""
    key = naming.cache_label_key(digest, namespace)
    pools = list(pools)
    total = cached = 0
    for node in nodes:
        node_labels = (node.get("metadata") or {}).get("labels") or {}
        if node_selected(node_labels, selector, pools, allow_control_plane):
            total += 1
            cached += node_labels.get(key) == naming.CACHE_LABEL_READY
    return cached, total
