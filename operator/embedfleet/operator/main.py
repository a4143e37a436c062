"""Run the operator in-process: what ``embedfleet operator run`` (cli.py) calls.

A thin wrapper over ``kopf.run`` so the CLI, the Helm chart's container command and tests all start the
same thing: every handler registered (``embedfleet.operator.handlers``), cluster-wide or limited to some
namespaces, with a liveness endpoint for the kubelet and kopf peering for HA (several replicas, one
active; the highest priority wins).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import kopf

ROLES = ("standalone", "spoke", "hub")
log = logging.getLogger(__name__)


def run_operator(
    role: str = "standalone",
    namespaces: Sequence[str] | None = None,
    *,
    liveness_endpoint: str | None = None,
    peering: str | None = None,
    priority: int = 0,
    verbose: bool = False,
    debug: bool = False,
) -> int:
    """Block until the operator stops; returns a process exit code.

    ``namespaces=None`` (or empty) watches all namespaces. ``peering=None`` runs standalone (no peering
    objects needed); a name joins that KopfPeering (cluster-wide) / ClusterKopfPeering, installed by the
    chart, so only one replica handles events at a time. ``role`` is exported as EMBEDFLEET_ROLE for
    handlers that differ between a hub and a spoke; today both run the same reconcile handlers.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    os.environ["EMBEDFLEET_ROLE"] = role
    kopf.configure(verbose=verbose, debug=debug)
    import embedfleet.operator.handlers  # noqa: F401  (registers the handlers)

    watched = [ns for ns in (namespaces or []) if ns]
    log.info(
        "embedfleet operator: role=%s namespaces=%s peering=%s", role, watched or "all", peering or "none"
    )
    kopf.run(
        clusterwide=not watched,
        namespaces=watched,
        standalone=peering is None,
        peering_name=peering,
        priority=priority,
        liveness_endpoint=liveness_endpoint,
    )
    return 0
