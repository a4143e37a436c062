"""The operator's own Prometheus metrics, and the endpoint that serves them (docs/metrics.md, "Operator").

Every role exports them (standalone, spoke, hub), standbys included: a standby says ``leader 0``.

* Reconciles: every kopf handler of a kind (create, update, resume, delete, the timers and the owned-object
  event handlers) is wrapped here, in one place, after the role's modules registered them
  (``instrument_handlers``): ``embedfleet_operator_reconcile_seconds{kind,result}`` and
  ``embedfleet_operator_reconcile_errors_total{kind,reason}``. Daemons (they run for an object's life),
  indexes and start-up/clean-up activities are not reconciles and are left alone. kopf has no public way
  to wrap a registered handler, so this replaces each handler in the registry's lists with a copy whose
  ``fn`` is wrapped (the handler's id, hence kopf's progress annotations, stays the same);
  tests/operator/test_operator_metrics.py fails when a kopf upgrade moves those lists.
* Watches: the hub's informers count a watch that ended in an error and is opened again
  (``embedfleet_operator_watch_restarts_total{kind}``, hub/informer.py).
* Cold starts: ``embedfleet_cold_start_seconds{phase}``, each runtime pod's creation -> first Ready by
  phase (handlers/cold_start.py; the pure part in cold_start.py).
* Leadership: ``embedfleet_operator_leader{role}`` (main.py sets it around the Lease).
* The hub: its reconcilers are timed in the same reconcile metrics (kinds ``FleetCluster``, ``Placement``,
  ``PlacementPolicy``; hub/controller.py), its work queue in ``embedfleet_operator_workqueue_*{name="hub"}``
  (the kit's); placement pass time, each spoke's breaker (hub/clusters.py) and the spoke write queue
  (hub/writes.py).

The endpoint is prometheus_client's own ``start_http_server`` on a port of its own (``--metrics-port``,
``$EMBEDFLEET_OPERATOR_METRICS_PORT``, default 8081), not a route of the health server (health.py): that one
is only started with ``--liveness`` and answers the kubelet, whose probes must not wait behind a scrape;
prometheus_client's server also does the content negotiation (OpenMetrics) and gzip a scraper asks for. A
port that cannot be bound is logged and the operator runs on without metrics: metrics observe the control
plane and must never stop it (the scrape target's ``up == 0`` shows the gap).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from embedfleet.operator.cold_start import POD_PHASES

log = logging.getLogger(__name__)

ENV_METRICS_PORT = "EMBEDFLEET_OPERATOR_METRICS_PORT"
DEFAULT_METRICS_PORT = 8081

#: result label values of the reconcile histogram
OK, REJECTED, RETRY, ERROR = "ok", "rejected", "retry", "error"
#: reason label values of the error counter
INVALID_SPEC, TEMPORARY, PERMANENT, EXCEPTION = "invalid_spec", "temporary", "permanent", "exception"

RECONCILE_SECONDS = Histogram(
    "embedfleet_operator_reconcile_seconds",
    "Time one kopf handler of a kind took, by result: ok, rejected (the spec is invalid: Accepted=False), "
    "retry (kopf.TemporaryError: kopf runs it again), error (any other exception)",
    ["kind", "result"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
RECONCILE_ERRORS = Counter(
    "embedfleet_operator_reconcile_errors_total",
    "Handlers of a kind that did not end ok, by reason: invalid_spec, temporary, permanent, exception",
    ["kind", "reason"],
)
WATCH_RESTARTS = Counter(
    "embedfleet_operator_watch_restarts_total",
    "Watches of the operator's own informers opened again after an error or an expired version (410)",
    ["kind"],
)
LEADER = Gauge("embedfleet_operator_leader", "1 when this replica acts (holds the Lease, or runs without "
               "leader election), 0 while it waits as a standby", ["role"])
HUB_ROUND_SECONDS = Histogram(
    "embedfleet_operator_hub_round_seconds", "Time one hub placement pass took (hub role, the leader only)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0),
)
HUB_ROUND_FAILURES = Counter("embedfleet_operator_hub_round_failures_total",
                             "Hub placement passes that raised (retried with back-off)")
BREAKER_OPEN = Gauge("embedfleet_operator_breaker_open",
                     "1 while the hub's circuit breaker for a spoke holds its writes back, else 0", ["cluster"])
HUB_WRITES_QUEUED = Gauge("embedfleet_operator_hub_writes_queued",
                          "Writes to spokes handed to the spokes' writer threads and not finished yet")
HUB_WRITE_BATCH_SECONDS = Histogram(
    "embedfleet_operator_hub_write_batch_seconds",
    "Time from handing one spoke's batch of writes to its writer thread until the batch finished",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)

#: Same name, type and buckets as the runtime's own (runtime/embedfleet/runtime/cold_start.py), whose phases
#: are the parts inside the container: one dashboard query reads both (docs/observability.md, "Cold starts").
COLD_START_SECONDS = Histogram(
    "embedfleet_cold_start_seconds",
    "A runtime pod's time from creation to its first Ready, by phase as the Pod shows it: scheduling, init "
    "(init containers: the model fetch), image_pull (to the last container started), runtime_start (to Ready)",
    ["phase"],
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200),
)
for _phase in POD_PHASES:  # exported at 0 from the start, so a pod's first cold start is a change
    COLD_START_SECONDS.labels(phase=_phase)

#: spec.spot over every deployment this operator serves (handlers/spot.py), without a deployment label like
#: every operator metric: replicas the spot sides ask for, those serving, and the on-demand stand-ins.
SPOT_REPLICAS = Gauge("embedfleet_operator_spot_replicas",
                      "Spot replicas over all deployments with spec.spot: asked (the spot Deployments' replicas), "
                      "serving (Ready on a node not being reclaimed), stand_in (on-demand replicas in their place)",
                      ["state"])
for _state in ("asked", "serving", "stand_in"):
    SPOT_REPLICAS.labels(state=_state)
SPOT_RECLAIMED = Counter("embedfleet_operator_spot_reclaimed_pods_total",
                         "Spot pods found on a node being reclaimed (a termination taint, deleted, NotReady or gone)")
SPOT_EVICTIONS = Counter("embedfleet_operator_spot_evictions_total",
                         "Spot pods on a reclaimed node evicted once their on-demand stand-ins were ready")

#: Set by the handler wrapper for the call it times: a list the handler's code can mark as rejected.
_CALL: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("embedfleet_reconcile", default=None)


def start_metrics_server(port: int, host: str = "0.0.0.0") -> bool:
    """Serve ``/metrics`` on ``port`` from a daemon thread; False (logged) when it cannot be bound."""
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        log.error("metrics: cannot serve on %s:%d, running without metrics: %s", host, port, exc)
        return False
    log.info("metrics: serving on http://%s:%d/metrics", host, port)
    return True


def observe_cold_start(phases: dict[str, float]) -> None:
    """One pod's cold start (operator/cold_start.py pod_phases), one observation per phase."""
    for phase, seconds in phases.items():
        COLD_START_SECONDS.labels(phase=phase).observe(seconds)


def set_leader(role: str, acting: bool) -> None:
    LEADER.labels(role=role).set(1 if acting else 0)


def note_rejected() -> None:
    """The running handler refused its object's spec (handlers/common.reject): counted as ``rejected``."""
    call = _CALL.get()
    if call is not None:
        call.append(REJECTED)


def _outcome(exc: BaseException | None, call: list[str]) -> tuple[str, str | None]:
    """(result, error reason or None) of one handler call."""
    import kopf

    if exc is None:
        return (REJECTED, INVALID_SPEC) if call else (OK, None)
    if isinstance(exc, kopf.TemporaryError):
        return RETRY, TEMPORARY
    if isinstance(exc, kopf.PermanentError):
        return ERROR, PERMANENT
    return ERROR, EXCEPTION


def _record(kind: str, started: float, exc: BaseException | None, call: list[str]) -> None:
    result, reason = _outcome(exc, call)
    RECONCILE_SECONDS.labels(kind=kind, result=result).observe(time.monotonic() - started)
    if reason is not None:
        RECONCILE_ERRORS.labels(kind=kind, reason=reason).inc()


def _kind(kwargs: dict[str, Any]) -> str:
    resource = kwargs.get("resource")
    kind = getattr(resource, "kind", None) or (kwargs.get("body") or {}).get("kind")
    return str(kind or "unknown")


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a kopf handler, sync or async) counted in the reconcile metrics by the kind it ran for."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def run_async(**kwargs: Any) -> Any:
            call: list[str] = []
            token = _CALL.set(call)
            started, failure = time.monotonic(), None
            try:
                return await fn(**kwargs)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                _CALL.reset(token)
                if not isinstance(failure, (asyncio.CancelledError, GeneratorExit, KeyboardInterrupt)):
                    _record(_kind(kwargs), started, failure, call)

        return run_async

    @functools.wraps(fn)
    def run(**kwargs: Any) -> Any:
        call: list[str] = []
        token = _CALL.set(call)
        started, failure = time.monotonic(), None
        try:
            return fn(**kwargs)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _CALL.reset(token)
            _record(_kind(kwargs), started, failure, call)

    return run


def instrument_handlers(registry: Any = None) -> int:
    """Wrap every reconcile handler registered so far with ``timed``; returns how many were wrapped.

    Reconciles are the changing handlers (create, update, resume, delete), the event handlers (owned
    objects) and the timers. Wrapping twice is a no-op."""
    import kopf
    from kopf._core.intents.handlers import TimerHandler  # kopf exports no handler types

    registry = registry or kopf.get_default_registry()
    lists = (registry._changing._handlers, registry._watching._handlers, registry._spawning._handlers)
    wrapped = 0
    for handlers in lists:
        for i, handler in enumerate(handlers):
            if handlers is registry._spawning._handlers and not isinstance(handler, TimerHandler):
                continue  # a daemon runs for its object's life: not a reconcile
            if getattr(handler.fn, "__embedfleet_timed__", False):
                continue
            fn = timed(handler.fn)
            fn.__embedfleet_timed__ = True  # type: ignore[attr-defined]
            handlers[i] = dataclasses.replace(handler, fn=fn)
            wrapped += 1
    return wrapped
