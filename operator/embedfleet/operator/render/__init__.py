"""EmbeddingDeployment spec -> the Kubernetes objects that run it. Pure: no I/O, no clock, no kopf.

Everything the operator creates is decided here, so a reader (or a test) can see the whole cluster
footprint of one spec by calling `render`. Every object is namespaced and carries an owner reference to
the custom resource, so the API server's garbage collector removes it with its owner. Nothing rendered
here holds a node right: pre-pulling is the chart's node agent's job (`embedfleet cache agent`, one
DaemonSet in the operator's namespace), which reads the same specs and fills the node cache.

One module per kind of object, this package's ``render`` composes them in apply order:

* ``common``: metadata, labels, selectors, owner references, security contexts, the content hash;
* ``revisions``: the default run and the names, labels and spec of one revision (docs/rollouts.md);
* ``model``: how model files reach the runtime (volumes, the ``fetch-model`` init container, the path
  ``EMBEDFLEET_MODEL`` names);
* ``config``: the runtime's ConfigMap (its ``EMBEDFLEET_*`` contract);
* ``deployment``: the runtime Deployment (pod template, placement, rollout strategy, replicas);
* ``service``: the Services, the PodDisruptionBudget and the ServiceMonitor;
* ``cache_volumes``: the node cache's claims and PersistentVolumes behind the pods' cache volumes. Not part
  of `render`'s list: a claim is shared by the deployments of a namespace that want the same entry, and a
  volume is cluster-scoped (handlers/cache_volumes.py creates them from `wanted_claims` of that list).

Every name other code uses is re-exported here: import from ``embedfleet.operator.render``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from embedfleet.operator import spot
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.platform import SpotRules
from embedfleet.operator.render.common import (
    CONFIG_HASH_ANNOTATION,
    RUNTIME_UID,
    Manifest,
    config_map_name,
    content_hash,
    labels,
    owner_reference,
    runtime_name,
    selector_labels,
    selector_string,
)
from embedfleet.operator.render.config import render_config_map, runtime_env
from embedfleet.operator.render.deployment import (
    API_KEYS_DIR,
    API_KEYS_FILE,
    API_KEYS_MODE,
    GRACE_MARGIN_SECONDS,
    PRESTOP_SLEEP_SECONDS,
    effective_replicas,
    render_deployment,
    rollout_strategy,
)
from embedfleet.operator.render.model import (
    CONTAINER_CACHE_DIR,
    LOCAL_CACHE_DIR,
    NODE_CACHE_DIR,
    PVC_MOUNT_DIR,
    downloaded,
    model_dir,
)
from embedfleet.operator.render.revisions import (
    FIRST_REVISION,
    REVISION_COMPONENT,
    default_runs,
    revision_config_map_name,
    revision_labels,
    revision_object_name,
    spec_for,
)
from embedfleet.operator.render.service import SERVICE_PORT, render_pdb, render_service, render_service_monitor
from embedfleet.operator.rollout.revisions import Run

__all__ = [
    "API_KEYS_DIR",
    "API_KEYS_FILE",
    "API_KEYS_MODE",
    "CONFIG_HASH_ANNOTATION",
    "CONTAINER_CACHE_DIR",
    "FIRST_REVISION",
    "GRACE_MARGIN_SECONDS",
    "LOCAL_CACHE_DIR",
    "NODE_CACHE_DIR",
    "PRESTOP_SLEEP_SECONDS",
    "PVC_MOUNT_DIR",
    "REVISION_COMPONENT",
    "RUNTIME_UID",
    "SERVICE_PORT",
    "Manifest",
    "config_map_name",
    "content_hash",
    "default_runs",
    "downloaded",
    "effective_replicas",
    "labels",
    "model_dir",
    "owner_reference",
    "render",
    "render_config_map",
    "render_deployment",
    "render_pdb",
    "render_service",
    "render_service_monitor",
    "revision_config_map_name",
    "revision_labels",
    "revision_object_name",
    "rollout_strategy",
    "runtime_env",
    "runtime_name",
    "selector_labels",
    "selector_string",
    "spec_for",
    "spot_split",
]


def render(
    name: str,
    namespace: str,
    uid: str,
    spec: EmbeddingDeploymentSpec,
    *,
    allow_control_plane: bool = False,
    autoscaler_desired: int | None = None,
    service_monitor_available: bool = False,
    platform_env: Mapping[str, str] | None = None,
    runs: Sequence[Run] | None = None,
    query_vector_space: str | None = None,
    default_image: str | None = None,
    spot_status: Mapping[str, Any] | None = None,
    spot_rules: SpotRules | None = None,
) -> list[Manifest]:
    """Every object one EmbeddingDeployment needs, in apply order (config before its consumers).

    ``allow_control_plane`` lifts the rule that keeps runtime pods off control-plane nodes;
    ``platform_env`` is added to every runtime's configuration (the platform's tracing settings);
    ``default_image`` is the platform's runtime image for a spec that names none.
    ``runs`` are the revisions to run (rollout.revisions.decide; default: the spec as r1), the primary
    first, and ``query_vector_space`` the one the main Service selects (default: the primary's).
    With ``spec.spot`` the primary revision runs as an on-demand and a spot Deployment, split as
    ``spot_status`` (the spot daemon's last ``status.spot``) says for this total (`spot_split`), on the
    nodes ``spot_rules`` (the platform's) call spot.
    """
    runs = list(runs or default_runs(spec))
    primary = next(r for r in runs if r.primary)
    config = render_config_map(name, namespace, uid, spec, platform_env, primary)
    replicas = effective_replicas(spec, autoscaler_desired)
    deployments = [render_deployment(name, namespace, uid, spec, replicas, content_hash(config["data"]),
                                     allow_control_plane=allow_control_plane, run=primary,
                                     default_image=default_image)]
    if spec.spot is not None:
        rules = spot_rules or SpotRules()
        deployments = list(spot.render_pair(deployments[0], spot_split(spec, replicas, spot_status),
                                            rules.node_labels, rules.taint_pairs()))
    out = [
        config,
        *deployments,
        render_service(name, namespace, uid, spec, query_vector_space or primary.vector_space),
        render_pdb(name, namespace, uid),
    ]
    for run in runs:
        if run.primary:
            continue
        side_config = render_config_map(name, namespace, uid, spec, platform_env, run)
        out += [side_config,
                render_deployment(name, namespace, uid, spec, run.replicas or 1, content_hash(side_config["data"]),
                                  allow_control_plane=allow_control_plane, run=run,
                                  default_image=default_image)]
        if run.revision != primary.revision:
            out.append(render_service(name, namespace, uid, spec, run=run))
    if spec.monitoring.service_monitor and service_monitor_available:
        out.append(render_service_monitor(name, namespace, uid, spec))
    return out


def spot_split(spec: EmbeddingDeploymentSpec, total: int, spot_status: Mapping[str, Any] | None) -> spot.Split:
    """The split to render: the spot daemon's, while it was made for this total; otherwise with as many
    stand-ins as it last kept (none recorded: none, since a new spot replica is starting, not failing; the
    spot daemon's first tick raises stand-ins for those that cannot run)."""
    assert spec.spot is not None
    cap = spot.spot_cap(total, spec.spot.max)
    fallback = spec.spot.fallback == "onDemand"
    recorded = spot_status or {}
    if recorded.get("total") == total and recorded.get("spot") == cap:
        return spot.Split(total, cap, int(recorded.get("onDemand") or 0), int(recorded.get("fallback") or 0))
    stand_ins = int(recorded.get("fallback") or 0)
    return spot.split(total, cap, stand_ins, fallback)
