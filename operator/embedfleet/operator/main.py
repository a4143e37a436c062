"""Run the operator in-process: what ``embedfleet operator run`` (cli.py) calls.

A thin wrapper over ``kopf.run`` so the CLI, the Helm chart's container command and tests all start the
same thing: the handlers of the role (``ROLE_HANDLERS``: the role switch is here and nowhere else),
cluster-wide or limited to some namespaces. With leader election (the default) the process first waits
to hold the operator Lease (leader.py) and only then starts kopf, so of several replicas exactly one acts;
the others are warm standbys.

The kubelet's endpoints (health.py) are served from process start, before the Lease: ``/healthz`` (live:
the process, and kopf's event loop once it runs) and ``/readyz`` (the role's handlers loaded, the API
server answering and serving the role's custom resources, and kopf started where this replica acts; a
standby is ready to take over). kopf's own liveness endpoint is not used: it starts only with kopf.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import kopf

from embedfleet.operator import background, metrics
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import FLEET_CLUSTER_PLURAL, PLACEMENT_POLICY_PLURAL
from embedfleet.operator.health import HealthServer, ServedResources, loop_responsive, parse_endpoint

if TYPE_CHECKING:
    from embedfleet.operator.leader import LeaderElector

#: What each role runs. Importing a module registers its kopf handlers. standalone/spoke reconcile
#: EmbeddingDeployments and ModelCaches into pods and scale them; a spoke also renews its heartbeat Lease;
#: the hub only places deployments on spokes (hub/controller.py), never pods of its own.
_LOCAL = ("embedfleet.operator.handlers.settings", "embedfleet.operator.handlers.embedding",
          "embedfleet.operator.handlers.model_cache", "embedfleet.operator.handlers.autoscale_daemon",
          "embedfleet.operator.handlers.cold_start", "embedfleet.operator.handlers.spot")
ROLE_HANDLERS: dict[str, tuple[str, ...]] = {
    "standalone": _LOCAL,
    "spoke": (*_LOCAL, "embedfleet.operator.spoke.handlers"),
    "hub": ("embedfleet.operator.handlers.settings", "embedfleet.operator.hub.handlers"),
}
ROLES = tuple(ROLE_HANDLERS)
#: The custom resources each role works on (embedfleet.dev/v1alpha1): not ready until they are served.
_WORKLOADS = (naming.EMBEDDING_DEPLOYMENT_PLURAL, naming.MODEL_CACHE_PLURAL)
ROLE_RESOURCES: dict[str, tuple[str, ...]] = {
    "standalone": _WORKLOADS,
    "spoke": _WORKLOADS,
    "hub": (naming.EMBEDDING_DEPLOYMENT_PLURAL, FLEET_CLUSTER_PLURAL, PLACEMENT_POLICY_PLURAL),
}
#: Request logging of the HTTP clients (the autoscaler's scrapes: several lines every few seconds) is
#: kept for --debug.
QUIET_LOGGERS = ("httpx", "httpcore")
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


class ProcessState:
    """What this operator process is doing, as its health checks read it (health.py). Written by the main
    thread, read by the health server's: single assignments, no lock needed."""

    def __init__(self) -> None:
        self.phase = "loading"  # loading -> standby -> acting
        self.loop: asyncio.AbstractEventLoop | None = None
        #: kopf raises it once its startup handlers have run and its watches start.
        self.kopf_started = threading.Event()

    def handlers(self) -> str | None:
        return "loading the role's handlers" if self.phase == "loading" else None

    def controller(self) -> str | None:
        if self.phase == "acting" and not self.kopf_started.is_set():
            return "kopf is starting (startup handlers)"
        return None  # a standby is ready to take over; loading is the handlers check's to report

    def kopf_loop(self) -> str | None:
        loop = self.loop
        return loop_responsive(loop) if loop is not None and loop.is_running() else None


def _probe_client() -> object:
    """The operator's API client without urllib3's retries: one try per probe (retries would log two
    warnings on every probe while the API server is unreachable)."""
    import kubernetes  # slow to import: here, like kube.py's users

    from embedfleet.operator.kube import load_client, user_agent

    config = load_client().configuration
    config.retries = False
    client = kubernetes.client.ApiClient(configuration=config)
    client.user_agent = user_agent()
    return client


def start_health(endpoint: str, role: str, state: ProcessState) -> HealthServer:
    """Serve /healthz (at ``endpoint``'s path) and /readyz on ``endpoint``'s port; returns the server."""
    host, port, path = parse_endpoint(endpoint)
    api = ServedResources(_probe_client, naming.GROUP, naming.VERSION, ROLE_RESOURCES[role])
    return HealthServer(host, port, live={"kopf-loop": state.kopf_loop}, live_path=path,
                        ready={"handlers": state.handlers, "api": api, "controller": state.controller}).start()


def configure_logging(*, verbose: bool = False, debug: bool = False) -> None:
    """kopf's logging (INFO; ``verbose``/``debug`` more); the HTTP clients' request lines only with ``debug``."""
    kopf.configure(verbose=verbose, debug=debug)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)


def run_operator(
    role: str = "standalone",
    namespaces: Sequence[str] | None = None,
    *,
    liveness_endpoint: str | None = None,
    election: Election | None = None,
    metrics_port: int | None = None,
    verbose: bool = False,
    debug: bool = False,
) -> int:
    """Block until the operator stops; returns a process exit code.

    ``namespaces=None`` (or empty) watches all namespaces; ``role`` picks the handlers (ROLE_HANDLERS).
    ``metrics_port`` (None or 0: none) serves the operator's own metrics (metrics.py) from process start.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    election = election or Election()
    configure_logging(verbose=verbose, debug=debug)
    state = ProcessState()
    metrics.set_leader(role, False)
    if metrics_port:
        metrics.start_metrics_server(metrics_port)
    health = start_health(liveness_endpoint, role, state) if liveness_endpoint else None
    try:
        return _run(role, namespaces, election, state)
    finally:
        if health is not None:
            health.stop()


def _run(role: str, namespaces: Sequence[str] | None, election: Election, state: ProcessState) -> int:
    for module in ROLE_HANDLERS[role]:
        importlib.import_module(module)
    metrics.instrument_handlers()

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
        state.phase = "standby"
        try:
            elector.acquire()
        except KeyboardInterrupt:  # stopped while a standby: nothing to hand back
            return 0
        log.info("embedfleet operator: acquired leadership, starting handlers")
    state.phase = "acting"
    metrics.set_leader(role, True)
    # kopf's pool for synchronous handlers, ours so that shutdown can wait for it (kopf never does).
    handler_pool = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="kopf-handler")
    settings = kopf.OperatorSettings()
    settings.execution.executor = handler_pool
    try:
        # What kopf.run does, with the event loop in hand for the liveness check.
        with asyncio.Runner() as runner:
            state.loop = runner.get_loop()
            try:
                runner.run(kopf.operator(clusterwide=not watched, namespaces=watched, standalone=True,
                                         ready_flag=state.kopf_started, settings=settings))
            except asyncio.CancelledError:
                pass
    finally:
        metrics.set_leader(role, False)
        if elector is not None:
            hand_over(elector, handler_pool)
    return 0


#: How long shutdown waits for handlers and background workers to end before it leaves the Lease to expire.
SETTLE_S = 10.0


def hand_over(elector: LeaderElector, *pools: concurrent.futures.Executor, timeout: float = SETTLE_S) -> bool:
    """Release the Lease only once the work has ended (handler threads, background workers, spoke writers),
    so that a standby taking over at once never acts beside writes of ours still under way; else stop
    renewing and let the Lease expire (the process exits; the watchdog ends the acting at the renew
    deadline if it does not). True when released."""
    if background.settle(timeout, *pools):
        elector.release()
        return True
    elector.abandon()
    return False
