"""The autoscaler loop: one kopf daemon per EmbeddingDeployment. Read signal, decide, apply, explain.

Each tick: read the Deployment (its ``spec.replicas`` is the truth about the current size), read the
in-flight total (Prometheus or the pods' /metrics, see signals.py), feed the pure
`autoscale.desired_replicas`, then — only when something changed — write ``status.replicas.desired``
first and the Deployment's replicas second (so a reconcile running in between renders the new number,
never the old one), and record the decision and its reason in ``status.lastScaleDecision`` and as an
Event. The observation window and decision history live in this daemon's memory (a change of
``spec.autoscaling`` keeps them: a lower minReplicas waits out the scale-down window like any other
scale-down); after an operator restart they start empty.

A change of ``spec.replicas`` (the scale subresource: ``kubectl scale``, a gateway waking the fleet) is
applied at once through `autoscale.manual_replicas`, which records it in the history, so the fleet is
not scaled below it before ``scaleDown.stabilizationWindowSeconds`` has passed. While that window holds
more replicas than the load asks for, ``status.lastScaleDecision.reason`` says so once
(``ScaleDownStabilizing: holding N replicas until <time>``); the scale-down that ends it is a ``Scaled``
Event like any other, its reason naming the window that passed.

With direct scraping, a Ready pod that does not answer (refused, slow, over the body cap) still counts:
stale.py counts it at its last known load or the per-replica target, never 0, from per-pod memory this
daemon keeps between ticks. Only when no pod answered is the total unknown (keep the size, one
``SignalUnavailable`` Warning); a partly answering fleet gets one ``PodMetricsUnavailable`` Warning per
pod per `UNREACHABLE_WARN_EVERY_S`, not one per tick.

Probe drift rides on the same scrape (handlers/probe_drift.py, judged by rollout/drift.py): each pod's
``embedfleet_probe_cosine`` and ``embedfleet_probe_order_kept`` become ``status.probeDrift`` when the verdict
changes, and the conditions are then re-derived by the reconcile's own code (handlers/embedding.py
`refresh_status`), which folds it into ``Degraded``. With autoscaling off the daemon still scrapes, for the
probe only, every `drift_every_s`; with a Prometheus source it asks Prometheus (signals.query_probe) at that
pace.

An open ``spec.autoscaling.schedule`` window (autoscale_schedule.py) raises the floor each tick; the
decision's reason (status and Event) names the entry. A spoke's copy of a hub EmbeddingDeployment leaves
the schedule to the hub, whose fleet target (hub/autoscale.py) already counts it in this copy's
minReplicas.

The same scrape also carries each pod's engine counters (inputs run, busy seconds): `record_throughput`
turns them into this deployment's embeddings per busy second (spoke/throughput.py) in the spoke's registry
(kopf's ``memo.throughput``, set by spoke/handlers.py; absent in other roles), which the heartbeat reports
to the hub's cost ranking. No write to the object, no extra request.

Ownership of status fields is documented in operator/status.py: this daemon writes
``replicas.desired``, ``inFlight``, ``lastScaleDecision`` and ``probeDrift``, nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import kubernetes

from embedfleet.operator.autoscale import (
    AutoscalerConfig,
    Decision,
    History,
    Observation,
    desired_replicas,
    from_spec,
    manual_replicas,
    trim_observations,
)
from embedfleet.operator.autoscale_schedule import ScheduledFloor, scheduled_floor
from embedfleet.operator.autoscale_target import in_flight_target
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.gateway_signal import POD_LABELS as GATEWAY_POD_LABELS
from embedfleet.operator.gateway_signal import GatewayReading, gateway_port, gateway_targets, read_gateways
from embedfleet.operator.handlers import spot as spot_handlers
from embedfleet.operator.handlers.events import KIND, KUBE, now_iso, record_event
from embedfleet.operator.handlers.probe_drift import drift_every_s, probe_readings, prometheus_url, watch_drift
from embedfleet.operator.kube import KubeError
from embedfleet.operator.render import runtime_name
from embedfleet.operator.scheduling.learn import model_identity
from embedfleet.operator.signals import (
    ASYNC_DEPTH_QUERY,
    PodReading,
    Reading,
    pod_targets,
    query_async_depth,
    query_prometheus,
    render_query,
    scrape,
)
from embedfleet.operator.spoke import throughput
from embedfleet.operator.stale import FleetLoad, LastSeen, count_pods, due_warnings
from embedfleet.operator.validate import check

log = logging.getLogger(__name__)
RESOURCE = (naming.GROUP, naming.VERSION, naming.EMBEDDING_DEPLOYMENT_PLURAL)
IDLE_RECHECK_S = 5.0
#: A pod whose /metrics keeps failing is named in a Warning Event (and the log) at most this often.
UNREACHABLE_WARN_EVERY_S = 300.0
#: After writing a new status.replicas.desired, the daemon waits at most this long (seconds) for kopf's
#: view of the object to show it before it resizes the Deployment: see `_apply`.
STATUS_VISIBLE_WAIT_S = 5.0
#: Between ticks the daemon looks this often at its in-memory view for a change of spec.replicas (a
#: gateway waking the fleet from zero through the scale subresource, or `kubectl scale`): acted on at
#: once, not after the rest of the interval.
WAKE_POLL_S = 0.1


@dataclass
class LoopState:
    """What one daemon remembers between ticks."""

    observations: list[Observation] = field(default_factory=list)
    history: History = field(default_factory=History)
    signal_ok: bool = True
    last_mode: str | None = None
    #: spec.replicas as last seen (the daemon starts from the object's own): a change is a `kubectl scale`.
    seen_spec_replicas: int | None = None
    #: monotonic time status.inFlight was last written (it is throttled, see _status_update).
    in_flight_written_at: float = float("-inf")
    #: each listed pod's last successful scrape (stale.py counts a failing pod from it).
    pod_memory: Mapping[str, LastSeen] = field(default_factory=dict)
    #: monotonic time each failing pod was last named in a Warning (see UNREACHABLE_WARN_EVERY_S).
    unreachable_warned_at: dict[str, float] = field(default_factory=dict)
    #: status.probeDrift as this daemon last wrote it (kopf's view of the object may lag its own write).
    probe_drift: Mapping[str, Any] | None = None
    #: monotonic time of the last drift check made for drift alone (autoscaling off, or Prometheus).
    drift_checked_at: float = float("-inf")
    #: (replicas, monotonic end) of the scale-down hold status.lastScaleDecision last announced: a hold
    #: is said once, not every tick it lasts (see `hold_is_news`).
    announced_hold: tuple[int, float] | None = None
    #: names of the schedule entries open at the last tick (a change is logged).
    schedule_open: tuple[str, ...] = ()
    #: each pod's engine counters at the start of its current throughput window (spoke/throughput.py).
    engine_baselines: Mapping[str, throughput.Counters] = field(default_factory=dict)


def with_schedule(config: AutoscalerConfig, body: Mapping[str, Any], parsed: EmbeddingDeploymentSpec,
                  now: datetime) -> tuple[AutoscalerConfig, ScheduledFloor | None]:
    """The tick's config with the floor the open schedule windows raise at ``now`` (wall clock, UTC).
    None for a spec without a schedule, and for a hub's copy on a spoke (the hub counted the schedule in
    this copy's minReplicas; applying it again would raise every spoke to the fleet-wide floor)."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    if not parsed.autoscaling.schedule or labels.get(naming.MANAGED_BY_LABEL) == naming.HUB_MANAGED_BY:
        return config, None
    floor = scheduled_floor(parsed.autoscaling.schedule, now)
    by = floor.describe() if floor.active else ""
    return dataclasses.replace(config, scheduled_floor=floor.floor, scheduled_by=by), floor


def _iso_in(seconds: float) -> str:
    """The wall-clock time ``seconds`` from now (decisions run on the monotonic clock)."""
    return (datetime.now(UTC) + timedelta(seconds=max(seconds, 0.0))).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.index("", "v1", "pods", labels={naming.COMPONENT_LABEL: "runtime", naming.MANAGED_BY_LABEL: naming.MANAGED_BY})
def runtime_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    """Runtime pods by (namespace, deployment name), kept by the watch: a tick lists nothing."""
    return {(namespace, labels.get(naming.INSTANCE_LABEL, "")): dict(body)}


@kopf.index("apps", "v1", "deployments", labels={naming.COMPONENT_LABEL: "runtime",
                                                 naming.MANAGED_BY_LABEL: naming.MANAGED_BY})
def runtime_deployments(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
                        ) -> dict[tuple[str, str], Any]:
    """Runtime Deployments by (namespace, deployment name): a tick reads none."""
    return {(namespace, labels.get(naming.INSTANCE_LABEL, "")): dict(body)}


@kopf.index("", "v1", "pods", labels=GATEWAY_POD_LABELS)
def gateway_pods(body: kopf.Body, **_: Any) -> dict[str, Any]:
    """The cluster's gateway pods (chart, gateway.enabled): asked for held requests and last traffic."""
    return {"gateways": dict(body)}


def read_gateway_activity(name: str, namespace: str, gateways: Sequence[Mapping[str, Any]]) -> GatewayReading:
    return asyncio.run(read_gateways(gateway_targets(gateways, gateway_port()), f"{namespace}/{name}"))


def read_signal(name: str, namespace: str, autoscaling: dict[str, Any], port: int,
                pods: list[dict[str, Any]]) -> Reading:
    """In-flight total from Prometheus when a URL is configured, else from every Ready pod's /metrics."""
    url = prometheus_url(autoscaling)
    if url:
        query = render_query(autoscaling.get("query"), namespace, name, runtime_name(name))
        reading = query_prometheus(url, query)
        if reading.in_flight is None:  # Prometheus did not answer: do not wait on it twice in one tick
            return reading
        depth = query_async_depth(url, render_query(ASYNC_DEPTH_QUERY, namespace, name, runtime_name(name)))
        return dataclasses.replace(reading, async_depth=depth)
    return asyncio.run(scrape(pod_targets(pods, port)))


#: status.inFlight is an observation, not a decision: refresh it at most this often (seconds), and only
#: when it moved, so a fleet under steady traffic does not rewrite every object every tick.
IN_FLIGHT_REFRESH_S = 30.0


def explain(decision: Decision, now: float) -> str:
    """The decision's reason as status and Events show it: a scale-down hold first, with its end in
    wall-clock time."""
    if decision.hold_until is None:
        return decision.reason
    return (f"ScaleDownStabilizing: holding {decision.replicas} replicas until"
            f" {_iso_in(decision.hold_until - now)}; {decision.reason}")


def hold_is_news(decision: Decision, state: LoopState, now: float) -> bool:
    """Whether this decision starts a scale-down hold status has not told yet: a new held count, or the
    last announced hold's end has passed. A hold the load extends (a wobble around a count) is not
    re-announced every tick; a change of size ends the hold."""
    if decision.changed:
        state.announced_hold = None
    if decision.hold_until is None:
        return False
    told = state.announced_hold
    if told is not None and told[0] == decision.replicas and now <= told[1]:
        return False
    state.announced_hold = (decision.replicas, decision.hold_until)
    return True


def _status_update(decision: Decision, status: dict[str, Any], record: bool, refresh_in_flight: bool,
                   now: float = 0.0) -> dict[str, Any]:
    """Only the fields that differ from what status already says (no idle writes)."""
    update: dict[str, Any] = {}
    if (status.get("replicas") or {}).get("desired") != decision.replicas:
        update["replicas"] = {"desired": decision.replicas}
    if (record or refresh_in_flight) and status.get("inFlight") != decision.in_flight:
        update["inFlight"] = decision.in_flight
    if record:
        update["lastScaleDecision"] = {
            "time": now_iso(),
            "fromReplicas": decision.current,
            "toReplicas": decision.replicas,
            "inFlight": decision.in_flight,
            "mode": decision.mode,
            "reason": explain(decision, now)[:1024],
        }
    return update


def manual_scale(body: dict[str, Any], state: LoopState) -> int | None:
    """The replicas a change of spec.replicas through the scale subresource (`kubectl scale`, a gateway
    waking the fleet) asks for; None when spec.replicas did not change since the last tick. With
    autoscaling on it means what it means for an HPA-managed Deployment: the fleet is resized now, and
    the autoscaler goes on from that size (`autoscale.manual_replicas` clamps it and holds it for the
    scale-down window)."""
    replicas = (body.get("spec") or {}).get("replicas")
    previous, state.seen_spec_replicas = state.seen_spec_replicas, replicas
    if replicas is None or replicas == previous:
        return None
    return int(replicas)


def tick(
    name: str,
    namespace: str,
    body: dict[str, Any],
    config: AutoscalerConfig,
    autoscaling: dict[str, Any],
    port: int,
    state: LoopState,
    now: float,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    gateways: Sequence[Mapping[str, Any]] = (),
    spec: EmbeddingDeploymentSpec | None = None,
    live_desired: Callable[[], Any] | None = None,
    measured: throughput.Registry | None = None,
) -> Decision | None:
    """One round of the loop; returns the decision, or None when there was nothing to decide on.
    ``live_desired`` reads status.replicas.desired from kopf's live view of the object (see `_apply`).

    ``deployment`` and ``pods`` are the watch's latest view (kopf indexes): a tick reads nothing from
    the API server; it writes only when a decision or a throttled observation changed."""
    if deployment is None:
        return None  # the reconcile handler has not created it yet
    current = int((deployment.get("spec") or {}).get("replicas") or 0)
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)

    status = dict(body.get("status") or {})
    manual = manual_scale(body, state)
    if manual is not None:
        # A resize by hand needs no signal: apply it now; decisions go on from the new size.
        decision = manual_replicas(manual, config, state.history.with_current(current), now,
                                   in_flight=float(status.get("inFlight") or 0.0))
        state.history = decision.history
        hold_is_news(decision, state, now)  # a new size: any hold announced before is over
        return _apply(name, namespace, body, decision, state, now, record=True, live_desired=live_desired)

    reading = read_signal(name, namespace, autoscaling, port, pods)
    if spec is not None:
        if reading.source == "pods":
            watch_drift(name, namespace, body, spec, state, reading.pods)
            record_throughput(name, namespace, spec, state, reading.pods, measured)
        elif now - state.drift_checked_at >= drift_every_s(spec):
            state.drift_checked_at = now
            watch_drift(name, namespace, body, spec, state, probe_readings(name, namespace, autoscaling, port, []))
    fleet: FleetLoad | None = None
    if reading.source == "pods":
        fleet = count_pods(reading.pods, state.pod_memory, now, config.target_per_replica,
                           config.last_known_hold_s)
        state.pod_memory = fleet.memory
        reading = dataclasses.replace(reading, in_flight=fleet.in_flight, async_depth=fleet.async_depth)
        if fleet.in_flight is not None:
            warn_unreachable(body, fleet, state, now)
    if reading.in_flight is None:
        if state.signal_ok:
            message = f"no in-flight signal from {reading.source}, keeping {current}: " + "; ".join(
                reading.errors
            )
            record_event(body, "SignalUnavailable", message, type_="Warning")
        state.signal_ok = False
        return None
    state.signal_ok = True

    # Requests a gateway holds (no ready replica yet) are load; its last request time is activity.
    gateway = read_gateway_activity(name, namespace, gateways) if gateways else GatewayReading()
    if gateway.unknown:
        log.info("%s/%s: gateway activity unknown: %s", namespace, name, "; ".join(gateway.errors))
    depth = reading.async_depth
    if gateway.held:
        depth = (depth or 0.0) + gateway.held
    last_request = None if gateway.last_request_age_s is None else now - gateway.last_request_age_s
    observation = Observation(now, reading.in_flight, ready, depth, last_request_at=last_request,
                              activity_unknown=gateway.unknown)
    state.observations = trim_observations([*state.observations, observation], config, now)
    decision = desired_replicas(state.observations, config, state.history.with_current(current), now)
    if fleet is not None and fleet.estimated:
        estimates = "; ".join(p.describe(now) for p in fleet.estimated)
        decision = dataclasses.replace(decision, reason=f"{decision.reason}; estimated: {estimates}")
    state.history = decision.history
    first = not status.get("lastScaleDecision")
    held = hold_is_news(decision, state, now)
    return _apply(name, namespace, body, decision, state, now,
                  record=decision.changed or first or held or decision.mode != state.last_mode,
                  live_desired=live_desired)


def record_throughput(name: str, namespace: str, spec: EmbeddingDeploymentSpec, state: LoopState,
                      readings: Sequence[PodReading] | None, measured: throughput.Registry | None) -> None:
    """Feed the pods' engine counters to the spoke's throughput registry (nothing without one: not a spoke)."""
    if measured is None or readings is None:
        return
    resource = throughput.resource_of(spec.runtime.gpu.count, spec.runtime.gpu.type)
    counters = {r.pod: throughput.Counters(r.inputs, r.busy_s) for r in readings
                if r.inputs is not None and r.busy_s is not None}
    state.engine_baselines, window = throughput.advance(state.engine_baselines, counters)
    if window is not None and resource is not None:
        measured.record(f"{namespace}/{name}", model_identity(spec.model.source, spec.model.revision), resource,
                        window)


def warn_unreachable(body: dict[str, Any], fleet: FleetLoad, state: LoopState, now: float) -> None:
    """Name the pods counted without an answer in one Warning Event and a log line, each pod at most
    once per `UNREACHABLE_WARN_EVERY_S` (stale.due_warnings): a pod that stays unreachable is news
    once, not every tick."""
    due, state.unreachable_warned_at = due_warnings(fleet, state.unreachable_warned_at, now,
                                                    UNREACHABLE_WARN_EVERY_S)
    if not due:
        return
    message = (f"{len(due)} of {len(fleet.pods)} pods did not answer /metrics; counted as at least their last"
               " known load or the per-replica target, never 0: "
               + "; ".join(f"{p.describe(now)}: {p.error}" for p in due))
    log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], message)
    try:
        record_event(body, "PodMetricsUnavailable", message, type_="Warning")
    except (kubernetes.client.ApiException, OSError) as exc:
        log.warning("could not record the PodMetricsUnavailable event: %s", exc)


def _apply(name: str, namespace: str, body: dict[str, Any], decision: Decision, state: LoopState,
           now: float, record: bool, live_desired: Callable[[], Any] | None = None) -> Decision:
    """Write what changed: status first, then the Deployment's replicas, then an Event explaining the
    change.

    Between the two writes it waits (at most STATUS_VISIBLE_WAIT_S) until kopf's view of the object
    (``live_desired``) shows the new status.replicas.desired. The reconcile renders the Deployment's
    replicas from that view: the handler of the very event that changed spec.replicas (`kubectl scale`)
    still holds the old status, and so does an owned-Deployment handler whose watch event overtook the
    object's own; seen on a real API server: such a reconcile, running just after the Deployment was
    resized, put it back to the old size. Once the view shows the new status, kopf has finished the
    object's earlier handlers and its index holds the new number."""
    status = dict(body.get("status") or {})
    state.last_mode = decision.mode
    refresh = now - state.in_flight_written_at >= IN_FLIGHT_REFRESH_S
    update = _status_update(decision, status, record, refresh, now)
    if update:
        KUBE.patch_status(KIND, name, namespace, update)
        if "inFlight" in update:
            state.in_flight_written_at = now
    if decision.changed and "replicas" in update and live_desired is not None:
        _await_visible(live_desired, decision.replicas, f"{namespace}/{name}")
    if decision.changed:
        spot_spec = check(name, dict(body["spec"]))[0] if (body.get("spec") or {}).get("spot") else None
        spot_handlers.resize(name, namespace, body, spot_spec, decision.replicas)
        record_event(body, "Scaled", explain(decision, now))
        spec_replicas = (body.get("spec") or {}).get("replicas")
        if decision.replicas == 0 and spec_replicas not in (None, 0):
            # The scale subresource says 0 too (as an HPA keeps its target's scale true): a gateway's next
            # wake, setting it to 1, is then a change this daemon sees, not a write of the value already there.
            KUBE.patch_merge(KIND, name, namespace, {"spec": {"replicas": 0}})
            state.seen_spec_replicas = 0  # our own write, not a `kubectl scale`
    return decision


def _await_visible(live_desired: Callable[[], Any], replicas: int, what: str,
                   timeout: float = STATUS_VISIBLE_WAIT_S) -> bool:
    """Poll kopf's live view until status.replicas.desired reads ``replicas``; False after ``timeout``
    (the resize goes ahead: a late view only risks the revert `_apply` describes, which the next tick
    decides against again)."""
    deadline = time.monotonic() + timeout
    while live_desired() != replicas:
        if time.monotonic() >= deadline:
            log.info("%s: status.replicas.desired=%s not in the watch after %.0fs; resizing anyway", what,
                     replicas, timeout)
            return False
        time.sleep(0.02)
    return True


@kopf.daemon(*RESOURCE, cancellation_timeout=10.0)
async def autoscale(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str,
    body: kopf.Body,
    logger: kopf.Logger,
    runtime_pods: kopf.Index,
    runtime_deployments: kopf.Index,
    gateway_pods: kopf.Index,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Runs for as long as the EmbeddingDeployment exists; ``body`` is kopf's live view of it.

    Async on purpose: between ticks it holds nothing but a timer, and each tick's blocking I/O runs on a
    worker thread only for the tick's length. (A synchronous daemon holds one of kopf's few executor
    threads for the object's whole life: on 2 cores six deployments starved every other handler.)
    """
    # spec.replicas as the daemon first sees it is the starting point, not a request to resize (the
    # reconcile already rendered it); a later change of it is a `kubectl scale`.
    state = LoopState(seen_spec_replicas=(body.get("spec") or {}).get("replicas"))
    measured = memo.get("throughput")
    config_key: Any = None
    while not stopped:
        spec = dict(body.get("spec") or {})
        parsed, _ = check(name, spec)
        if parsed is None or not parsed.autoscaling.enabled:
            if parsed is not None and time.monotonic() - state.drift_checked_at >= drift_every_s(parsed):
                state.drift_checked_at = time.monotonic()
                await _drift_only(name, namespace, body, parsed, state, runtime_pods, logger, measured)
            await asyncio.sleep(IDLE_RECHECK_S)  # kopf cancels it on stop (see wait_for_tick)
            continue
        autoscaling = parsed.autoscaling.model_dump(by_alias=True, exclude_none=True)
        config = from_spec(autoscaling, in_flight_target(spec).per_replica)
        if config != config_key:
            if config_key is not None:
                # The history stays: its recommendations were made under the old bounds, so a lower
                # minReplicas removes pods only once the scale-down window has passed (a higher one, or
                # a lower maxReplicas, applies at once through the clamp).
                logger.info("autoscaling settings changed; decisions go on from the same history")
            config_key = config
        config, schedule = with_schedule(config, body, parsed, datetime.now(UTC))
        opened = schedule.active if schedule is not None else ()
        if opened != state.schedule_open:
            logger.info("schedule: %s", f"{', '.join(opened)} open (floor {schedule.floor})"
                        if schedule is not None and opened else "no window open")
            state.schedule_open = opened
        try:
            deployment = spot_handlers.autoscaler_view(runtime_deployments.get((namespace, name), []), name,
                                                       parsed, body.get("status"))
            pods = list(runtime_pods.get((namespace, name), []))
            gateways = list(gateway_pods.get("gateways", []))
            decision = await asyncio.to_thread(
                tick, name, namespace, dict(body), config, autoscaling, parsed.runtime.port, state,
                time.monotonic(), deployment, pods, gateways, parsed, lambda: _desired(body), measured,
            )
            if decision is not None and decision.changed:
                logger.info("%s", decision.reason)
        except (KubeError, kubernetes.client.ApiException, OSError) as exc:
            logger.warning("autoscaler tick failed, retrying next interval: %s", exc)
        await wait_for_tick(stopped, body, parsed.autoscaling.interval_seconds)


def _desired(body: Mapping[str, Any]) -> Any:
    return ((body.get("status") or {}).get("replicas") or {}).get("desired")


async def _drift_only(name: str, namespace: str, body: kopf.Body, parsed: EmbeddingDeploymentSpec,
                      state: LoopState, runtime_pods: kopf.Index, logger: kopf.Logger,
                      measured: throughput.Registry | None = None) -> None:
    """Autoscaling off: no tick scrapes the pods, so drift is read on its own (see `drift_every_s`); the
    throughput counters ride on that scrape too."""
    if parsed.rollout.probe_interval_seconds <= 0:
        return
    autoscaling = parsed.autoscaling.model_dump(by_alias=True, exclude_none=True)
    pods = list(runtime_pods.get((namespace, name), []))
    try:
        def check_drift() -> None:
            readings = probe_readings(name, namespace, autoscaling, parsed.runtime.port, pods)
            watch_drift(name, namespace, dict(body), parsed, state, readings)
            record_throughput(name, namespace, parsed, state, readings, measured)

        await asyncio.to_thread(check_drift)
    except (KubeError, kubernetes.client.ApiException, OSError) as exc:
        logger.warning("probe drift check failed, retrying later: %s", exc)


async def wait_for_tick(stopped: kopf.DaemonStopped, body: kopf.Body, seconds: float) -> None:
    """The interval, cut short when spec.replicas changes in kopf's live view of the object: a gateway
    holding requests for a fleet at zero scales it through the scale subresource and must not wait a
    whole interval for the pods (an in-memory check; nothing is read from the API server).

    It sleeps rather than `stopped.wait(0.1)`: kopf runs each time-limited wait as a task of its own, and
    one that timed out just as the operator's SIGTERM cancelled the daemon was left holding a TimeoutError
    that kopf re-raised on exit (exit code 1 instead of 0; seen in tests/gateway/test_wake_twice.py).
    The `stopped` flag is still read every WAKE_POLL_S."""
    seen = (body.get("spec") or {}).get("replicas")
    end = time.monotonic() + seconds
    while not stopped and time.monotonic() < end:
        await asyncio.sleep(min(WAKE_POLL_S, max(0.0, end - time.monotonic())))
        if (body.get("spec") or {}).get("replicas") != seen:
            return
