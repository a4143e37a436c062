"""Run the operator in-process: what ``embedfleet operator run`` (cli.py) calls.

A thin wrapper over ``kopf.run`` so the CLI, the Helm chart's container command and tests all start the
same thing: the handlers of the role (``ROLE_HANDLERS``: the role switch is here and nowhere else),
cluster-wide or limited to some namespaces, with a liveness endpoint for the kubelet. With leader
election (the default) the process first waits to hold the operator Lease (leader.py) and only then
starts kopf, so of several replicas exactly one acts; the others are warm standbys.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import kopf

#: What each role runs. Importing a module registers its kopf handlers. standalone/spoke reconcile
#: EmbeddingDeployments and ModelCaches into pods and scale them; a spoke also renews its heartbeat Lease;
#: the hub only places deployments on spokes (hub/loop.py), never pods of its own.
_LOCAL = ("embedfleet.operator.handlers.settings", "embedfleet.operator.handlers.embedding",
          "embedfleet.operator.handlers.model_cache", "embedfleet.operator.handlers.autoscale_daemon")
ROLE_HANDLERS: dict[str, tuple[str, ...]] = {
    "standalone": _LOCAL,
    "spoke": (*_LOCAL, "embedfleet.operator.spoke.handlers"),
    "hub": ("embedfleet.operator.handlers.settings", "embedfleet.operator.hub.handlers"),
}
ROLES = tuple(ROLE_HANDLERS)
ENV_POD_NAMESPACE = "POD_NAMESPACE"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Election:
    """Leader-election settings (client-go's names and defaults)."""

    enabled: bool = True
    namespace: str | None = None
    name: str = "embedfleet-operator"
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


def lease_namespace(election: Election) -> str:
    """Where the Lease lives: the flag, else the operator's own namespace (the chart's), else default."""
    return election.namespace or os.environ.get(ENV_POD_NAMESPACE) or "default"


def run_operator(
    role: str = "standalone",
    namespaces: Sequence[str] | None = None,
    *,
    liveness_endpoint: str | None = None,
    election: Election | None = None,
    verbose: bool = False,
    debug: bool = False,
) -> int:
    """Block until the operator stops; returns a process exit code.

    ``namespaces=None`` (or empty) watches all namespaces; ``role`` picks the handlers (ROLE_HANDLERS).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    election = election or Election()
    kopf.configure(verbose=verbose, debug=debug)
    for module in ROLE_HANDLERS[role]:
        importlib.import_module(module)

    watched = [ns for ns in (namespaces or []) if ns]
    log.info("embedfleet operator: role=%s namespaces=%s leader-election=%s", role, watched or "all",
             "on" if election.enabled else "off")
    elector = None
    if election.enabled:
        from embedfleet.operator.kube import Kube
        from embedfleet.operator.leader import LeaderElector

        elector = LeaderElector(
            Kube(), lease_namespace(election), election.name, lease_duration=election.lease_duration,
            renew_deadline=election.renew_deadline, retry_period=election.retry_period,
        )
        if role == "hub":  # a standby hub keeps its view of the fleet current (hub/handlers.py)
            from embedfleet.operator.hub.handlers import warm_standby

            warm_standby()
        try:
            elector.acquire()
        except KeyboardInterrupt:  # stopped while a standby: nothing to hand back
            return 0
        log.info("embedfleet operator: acquired leadership, starting handlers")
    try:
        kopf.run(
            clusterwide=not watched,
            namespaces=watched,
            standalone=True,
            liveness_endpoint=liveness_endpoint,
        )
    finally:
        if elector is not None:
            elector.release()
    return 0
