"""What every reconcile handler here does the same way: write only changed status, report a rejected spec."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from embedfleet.operator import metrics
from embedfleet.operator import status as st
from embedfleet.operator.cache.wanted import cache_node_counts
from embedfleet.operator.crd.models import NodePool
from embedfleet.operator.kube import Kube


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_status(patch: kopf.Patch, current: Any, wanted: dict[str, Any]) -> None:
    """Patch only the status fields whose value changed, so an idle reconcile writes nothing."""
    for key, value in st.status_patch(current, wanted).items():
        patch.status[key] = value


def reject(body: kopf.Body, patch: kopf.Patch, status: Any, problems: Iterable[str],
           generation: int | None, logger: kopf.Logger | None = None) -> None:
    """A spec the schema let through but we cannot run: Accepted=False listing every problem, an
    InvalidSpec event, and nothing created."""
    message = "; ".join(problems)
    metrics.note_rejected()
    if logger is not None:
        logger.warning("spec rejected: %s", message)
    kopf.warn(body, reason="InvalidSpec", message=message[:1000])
    rejected = st.condition("Accepted", False, "InvalidSpec", message, generation)
    conditions = st.merge_conditions(status.get("conditions"), [rejected], now())
    write_status(patch, status, {"observedGeneration": generation, "conditions": conditions})


def cache_nodes(kube: Kube, namespace: str, digest: str, selector: Mapping[str, str], pools: Iterable[NodePool],
                allow_control_plane: bool) -> tuple[int, int]:
    """(nodes the node agent reports ready for this tenant's digest, nodes the pools select), read from
    the Nodes' labels: the agent labels a node only once the weights are verified on its disk."""
    return cache_node_counts(kube.list("Node"), namespace, digest, selector, pools, allow_control_plane)
