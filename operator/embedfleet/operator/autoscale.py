"""The autoscaler's decision: observed in-flight requests and history in, desired replicas out.

One pure function per tick, in the manner of Knative's KPA and the HPA v2 ``behavior`` block, so the
whole policy can be read top to bottom in `desired_replicas` and tested by feeding it series of
observations. Nothing here touches Kubernetes, clocks or globals: the caller passes ``now`` and gets
the updated `History` back inside the `Decision`.

The formula, step by step (each step has its own named parameter):

1. load = in-flight requests across pods (+ requests held outside any pod during a cold start);
   target per replica = ``in_flight_per_replica * target_utilization`` (which number that is for a
   spec: autoscale_target.py).
2. stable desire = ceil(mean load over ``stable_window_s`` / target);
   panic desire = ceil(mean load over ``panic_window_s`` / target).
3. panic mode (KPA) starts when panic desire >= ``panic_threshold * current`` and lasts
   ``stable_window_s`` after the last trigger; in panic the fleet never shrinks.
4. tolerance band (HPA): in stable mode, if |load / (current * target) - 1| <= ``tolerance`` keep current.
5. floor: never below ceil(latest in-flight / in_flight_per_replica) — the work already accepted needs it.
6. scale to zero only when ``scale_to_zero`` is on and the load has been zero for ``scale_to_zero_grace_s``.
   A fleet at zero with no load stays at zero (only load, e.g. held requests, or a wake starts one).
   A schedule window that is open (``scheduled_floor``, autoscale_schedule.py) raises the floor above
   ``min_replicas``, outranks scale to zero (it wakes a fleet at zero) and, once closed, lowers the
   floor through step 7 like any other lower recommendation: no cliff.
7. stabilization (HPA v2): the result is the current count pulled up to the *lowest* recommendation of
   the scale-up window and down to the *highest* recommendation of the scale-down window. A count set by
   hand (`manual_replicas`: ``kubectl scale``, a gateway's wake) is a recommendation too, in the
   scale-down window only: it is lowered only once that window has passed with the load asking for fewer
   (the newest such count is a floor while in the window), and never delays a scale-up the load asks
   for. While the window holds more replicas than the load asks for, the decision says until when
   (``Decision.hold_until``).
8. rate limits (HPA v2, ``selectPolicy: Max``): per ``period_s`` grow by at most max(percent, pods)
   and shrink by at most max(percent, pods), counted from the replica count at the period's start.
9. clamp to [min_replicas, max_replicas] (0 allowed as the floor only by step 6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

Mode = Literal["stable", "panic", "manual"]


@dataclass(frozen=True)
class ScalingRules:
    """One direction's HPA v2 behaviour: a stabilization window and optional rate limits."""

    stabilization_window_s: float = 0.0
    max_percent: float | None = None
    max_pods: int | None = None
    period_s: float = 15.0

    def __post_init__(self) -> None:
        if self.stabilization_window_s < 0:
            raise ValueError("stabilizationWindowSeconds must be >= 0")
        if self.max_percent is not None and self.max_percent <= 0:
            raise ValueError("maxPercentPerPeriod must be > 0")
        if self.max_pods is not None and self.max_pods <= 0:
            raise ValueError("maxPodsPerPeriod must be > 0")
        if self.period_s <= 0:
            raise ValueError("periodSeconds must be > 0")

    @property
    def limited(self) -> bool:
        return self.max_percent is not None or self.max_pods is not None


DEFAULT_SCALE_UP = ScalingRules(stabilization_window_s=0.0, max_percent=100.0, max_pods=4, period_s=15.0)
DEFAULT_SCALE_DOWN = ScalingRules(
    stabilization_window_s=300.0, max_percent=100.0, max_pods=None, period_s=15.0
)


@dataclass(frozen=True)
class AutoscalerConfig:
    """Every knob of the policy, with the defaults documented in docs/autoscaling.md."""

    min_replicas: int = 1
    max_replicas: int = 10
    in_flight_per_replica: int = 32
    target_utilization: float = 0.7
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0
    scale_up: ScalingRules = field(default_factory=lambda: DEFAULT_SCALE_UP)
    scale_down: ScalingRules = field(default_factory=lambda: DEFAULT_SCALE_DOWN)
    tolerance: float = 0.1
    scale_to_zero: bool = False
    scale_to_zero_grace_s: float = 30.0
    #: The floor open schedule windows raise now (autoscale_schedule.scheduled_floor; the caller sets it
    #: each tick) and what raised it, for reasons ("schedule peak").
    scheduled_floor: int = 0
    scheduled_by: str = ""

    def __post_init__(self) -> None:
        problems = []
        if self.min_replicas < 0:
            problems.append("minReplicas must be >= 0")
        if self.max_replicas < 1:
            problems.append("maxReplicas must be >= 1")
        if self.min_replicas > self.max_replicas:
            problems.append(f"minReplicas ({self.min_replicas}) > maxReplicas ({self.max_replicas})")
        if self.in_flight_per_replica < 1:
            problems.append("inFlightPerReplica must be >= 1")
        if not 0 < self.target_utilization <= 1:
            problems.append("targetUtilization must be in (0, 1]")
        if self.stable_window_s <= 0 or self.panic_window_s <= 0:
            problems.append("stableWindowSeconds and panicWindowSeconds must be > 0")
        if self.panic_window_s > self.stable_window_s:
            problems.append("panicWindowSeconds must be <= stableWindowSeconds")
        if self.panic_threshold < 1:
            problems.append("panicThreshold must be >= 1")
        if not 0 <= self.tolerance < 1:
            problems.append("tolerance must be in [0, 1)")
        if self.scale_to_zero_grace_s < 0:
            problems.append("scaleToZero grace must be >= 0")
        if self.scheduled_floor < 0:
            problems.append("a scheduled floor must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def target_per_replica(self) -> float:
        return self.in_flight_per_replica * self.target_utilization

    @property
    def last_known_hold_s(self) -> float:
        """How long a pod that stopped answering is counted at its last known load (stale.py).

        Two stable windows: after that, no observation the decisions still average over was taken
        while the pod answered, so its old number is a guess; the pod then counts as one target's
        worth (neither grows nor shrinks the fleet) for as long as it is listed Ready.
        """
        return 2.0 * self.stable_window_s

    @property
    def floor(self) -> int:
        """Fewest replicas while traffic exists (zero only ever comes from the idle rule); an open schedule
        window raises it, never above maxReplicas."""
        return min(max(self.min_replicas, 1, self.scheduled_floor), self.max_replicas)

    @property
    def idles_to_zero(self) -> bool:
        """Scale to zero is on and no schedule window holds a floor: a known peak outranks idleness."""
        return self.scale_to_zero and self.scheduled_floor == 0

    @property
    def schedule_raises(self) -> bool:
        """Whether an open schedule window, not minReplicas, sets the floor."""
        return self.floor > max(self.min_replicas, 1)

    @property
    def longest_window_s(self) -> float:
        """How much observation and decision history the caller must keep."""
        return max(
            self.stable_window_s,
            self.scale_to_zero_grace_s,
            self.scale_up.stabilization_window_s,
            self.scale_down.stabilization_window_s,
            self.scale_up.period_s,
            self.scale_down.period_s,
        )


@dataclass(frozen=True)
class Observation:
    """One sample of the fleet.

    ``in_flight`` is the sum of ``embedfleet_requests_in_flight`` over pods (it already counts requests
    queued inside a pod); ``queue_depth`` counts work held *outside* the pods' HTTP queues: the async
    jobs waiting in Redis (``embedfleet_async_queue_depth``, KEDA-style: each job is one request's worth
    of load), or requests a gateway holds during a cold start from zero.

    ``last_request_at`` (same clock as ``timestamp``): the newest request a gateway routed to the
    deployment, so traffic between ticks counts as activity for scale-to-zero; ``activity_unknown``:
    a gateway did not answer, so idleness cannot be known and the fleet is not scaled to zero.
    """

    timestamp: float
    in_flight: float
    ready_pods: int
    queue_depth: float | None = None
    last_request_at: float | None = None
    activity_unknown: bool = False

    @property
    def load(self) -> float:
        return max(self.in_flight, 0.0) + max(self.queue_depth or 0.0, 0.0)


@dataclass(frozen=True)
class Recommendation:
    """One count the autoscaler recommended at ``at``, or (``manual``) one set by hand: the scale
    subresource (``kubectl scale``, a gateway waking the fleet from zero). A manual count counts in the
    scale-down window only."""

    at: float
    replicas: int
    manual: bool = False


@dataclass(frozen=True)
class ScaleEvent:
    at: float
    from_replicas: int
    to_replicas: int


@dataclass(frozen=True)
class History:
    """What one tick leaves for the next. Returned, never mutated; the caller just keeps the latest."""

    current_replicas: int | None = None
    recommendations: tuple[Recommendation, ...] = ()
    events: tuple[ScaleEvent, ...] = ()
    panic_until: float | None = None
    last_active_at: float | None = None

    def with_current(self, replicas: int) -> History:
        """The caller's view of the truth (the Deployment's replicas) wins over our own bookkeeping."""
        return replace(self, current_replicas=replicas)


@dataclass(frozen=True)
class Decision:
    replicas: int
    mode: Mode
    reason: str
    current: int
    stable_desired: int
    panic_desired: int
    in_flight: float
    history: History
    #: While the scale-down window holds more replicas than the load asks for: when (the caller's clock)
    #: the window stops holding them if the load stays as it is. None otherwise.
    hold_until: float | None = None

    @property
    def changed(self) -> bool:
        return self.replicas != self.current


def _mean_load(observations: Sequence[Observation], since: float, now: float) -> float | None:
    window = [o.load for o in observations if since < o.timestamp <= now]
    if not window:
        return None
    return sum(window) / len(window)


def _ceil_div(load: float, per_replica: float) -> int:
    # Round away float noise (50 / 32 * 32 must not become 2.0000000001 replicas of 1).
    return max(0, math.ceil(round(load / per_replica, 9)))


def _rate_bounds(current: int, history: History, config: AutoscalerConfig, now: float) -> tuple[int, float]:
    """(lowest, highest) replica counts the rate limits allow this tick."""
    up, down = config.scale_up, config.scale_down
    high: float = math.inf
    if up.limited:
        added = sum(
            e.to_replicas - e.from_replicas
            for e in history.events
            if e.at > now - up.period_s and e.to_replicas > e.from_replicas
        )
        base = max(current - added, 0)
        limits = []
        if up.max_percent is not None:
            limits.append(math.ceil(base * (1 + up.max_percent / 100.0)))
        if up.max_pods is not None:
            limits.append(base + up.max_pods)
        # A percentage of zero replicas is zero: always allow at least one step so scale-from-zero works.
        high = max(*limits, base + 1)
    low = 0
    if down.limited:
        removed = sum(
            e.from_replicas - e.to_replicas
            for e in history.events
            if e.at > now - down.period_s and e.to_replicas < e.from_replicas
        )
        base = current + removed
        limits = []
        if down.max_percent is not None:
            limits.append(math.floor(base * (1 - down.max_percent / 100.0)))
        if down.max_pods is not None:
            limits.append(base - down.max_pods)
        low = max(min(limits), 0)
    return low, high


def desired_replicas(
    observations: Sequence[Observation],
    config: AutoscalerConfig,
    history: History,
    now: float,
) -> Decision:
    """One autoscaler tick. See the module docstring for the formula."""
    latest = max((o for o in observations if o.timestamp <= now), key=lambda o: o.timestamp, default=None)
    current = history.current_replicas
    if current is None:
        current = latest.ready_pods if latest is not None else config.floor
    if latest is None:
        return Decision(
            replicas=current,
            mode="stable",
            reason=f"no observations yet: keep {current}",
            current=current,
            stable_desired=current,
            panic_desired=current,
            in_flight=0.0,
            history=replace(history, current_replicas=current),
        )

    target = config.target_per_replica
    stable_load = _mean_load(observations, now - config.stable_window_s, now)
    panic_load = _mean_load(observations, now - config.panic_window_s, now)
    stable_load = latest.load if stable_load is None else stable_load
    panic_load = stable_load if panic_load is None else panic_load
    stable_desired = _ceil_div(stable_load, target)
    panic_desired = _ceil_div(panic_load, target)

    # Panic (KPA): a burst seen in the short window that would at least `threshold`-fold the fleet.
    triggered = panic_desired > 0 and panic_desired >= config.panic_threshold * max(current, 1)
    panic_until = history.panic_until
    if triggered:
        panic_until = now + config.stable_window_s
    in_panic = panic_until is not None and now < panic_until
    if not in_panic:
        panic_until = None

    notes: list[str] = []
    if in_panic:
        raw = max(current, stable_desired, panic_desired)
        notes.append(
            f"panic: {panic_load:.1f} in flight over {config.panic_window_s:g}s needs {panic_desired}"
            f" (>= {config.panic_threshold:g}x of {current}); never shrinking until {panic_until:.0f}"
        )
    else:
        raw = stable_desired
        notes.append(
            f"{stable_load:.1f} in flight over {config.stable_window_s:g}s / {target:g} per replica"
            f" -> {stable_desired}"
        )
        if current > 0 and stable_load > 0:
            ratio = stable_load / (current * target)
            if abs(ratio - 1.0) <= config.tolerance:
                raw = current
                notes.append(f"utilisation {ratio:.2f} within tolerance {config.tolerance:g}: keep {current}")

    need = _ceil_div(latest.in_flight + (latest.queue_depth or 0.0), config.in_flight_per_replica)
    if raw < need:
        notes.append(f"{latest.load:g} requests in flight need {need}")
        raw = need

    last_active = history.last_active_at
    active_times = [o.timestamp for o in observations if o.load > 0 and o.timestamp <= now]
    active_times += [min(o.last_request_at, now) for o in observations if o.last_request_at is not None]
    if active_times:
        last_active = max(active_times + ([last_active] if last_active is not None else []))
    elif last_active is None:
        last_active = now  # never seen traffic: the grace period starts now, not at the epoch
    idle_for = now - last_active
    if config.idles_to_zero and latest.load == 0 and current == 0:
        # Nothing asks for a replica: a fleet at zero stays there (waking comes from load, i.e. requests a
        # gateway holds, or from its scale subresource); the grace period is for getting *to* zero.
        raw = 0
        notes.append("at zero with no load: staying at zero until a request comes")
    elif config.idles_to_zero and latest.load == 0 and latest.activity_unknown:
        raw = max(raw, config.floor, 1 if current > 0 else 0)
        notes.append("a gateway did not say when it last saw traffic: not scaling to zero")
    elif config.idles_to_zero and latest.load == 0 and idle_for >= config.scale_to_zero_grace_s:
        raw = 0
        notes.append(f"idle for {idle_for:.0f}s >= {config.scale_to_zero_grace_s:g}s: scale to zero")
    else:
        if raw < config.floor:
            raw = config.floor
            if config.schedule_raises:
                notes.append(f"{config.scheduled_by} keeps at least {config.floor}")
        if config.idles_to_zero and latest.load == 0:
            notes.append(f"idle for {idle_for:.0f}s, scale to zero after {config.scale_to_zero_grace_s:g}s")
    raw = min(raw, config.max_replicas)

    # Stabilization (HPA v2): compare with the recommendations still inside each window. A count set by
    # hand sits in the scale-down window (it holds the fleet up) but not in the scale-up one (the load's
    # own recommendations alone decide how soon it grows).
    recommendations = (*history.recommendations, Recommendation(now, raw))
    up_cut = now - config.scale_up.stabilization_window_s
    down_window = config.scale_down.stabilization_window_s
    down_cut = now - down_window
    up_rec = min(r.replicas for r in recommendations if r.at >= up_cut and not r.manual)
    down_rec = max(r.replicas for r in recommendations if r.at >= down_cut)
    result = current
    if result < up_rec:
        result = up_rec
    if result > down_rec:
        result = down_rec
    if result < raw:
        notes.append(f"stabilized to {result} (up window min {up_rec}, down window max {down_rec})")

    # Rate limits bound a move away from the current count; they never move the fleet the other way.
    low, high = _rate_bounds(current, history, config, now)
    if result > max(high, current):
        notes.append(f"scale-up rate limit caps at {int(high)}")
        result = int(max(high, current))
    if result < min(low, current):
        notes.append(f"scale-down rate limit stops at {low}")
        result = min(low, current)

    # The newest count set by hand, while in the scale-down window, is a floor: should the fleet have been
    # set lower meanwhile by anything but a newer hand (a write racing ours), it goes back, as the hand
    # set it (no rate limit).
    by_hand = max((r for r in recommendations if r.manual), key=lambda r: r.at, default=None)
    if by_hand is not None and by_hand.at >= down_cut and result < by_hand.replicas:
        notes.append(f"{by_hand.replicas} set by hand {now - by_hand.at:.0f}s ago holds for the"
                     f" {down_window:g}s scale-down window")
        result = by_hand.replicas

    # Zero is reachable only by the idle rule; a rate-limited walk towards it stops at the floor first.
    floor = 0 if raw == 0 and result == 0 else config.floor
    bounded = min(max(result, floor), config.max_replicas)
    if bounded != result:
        notes.append(f"clamped to [{floor}, {config.max_replicas}]")
        result = bounded

    hold_until = None
    holders = [r for r in recommendations if r.at >= down_cut and r.replicas >= result]
    if result > raw and down_rec > raw and holders:
        # The scale-down window holds more than the load asks for: this count until the newest
        # recommendation of at least as many leaves the window.
        newest = max(holders, key=lambda r: r.at)
        hold_until = newest.at + down_window
        notes.append(
            f"scale-down window {down_window:g}s holds {result} for {hold_until - now:.0f}s more"
            f" ({newest.replicas} {_recommended(newest)} {now - newest.at:.0f}s ago; the load alone asks for {raw})"
        )
    elif result < current and down_window > 0:
        # Scaling down: say which higher recommendation the window no longer holds.
        gone = [r for r in history.recommendations if r.at < down_cut and r.replicas > result]
        if gone:
            newest = max(gone, key=lambda r: r.at)
            notes.append(
                f"scale-down window {down_window:g}s passed since {newest.replicas} was last"
                f" {_recommended(newest)} ({now - newest.at:.0f}s ago)"
            )

    keep_after = now - config.longest_window_s
    events = history.events
    if result != current:
        events = (*events, ScaleEvent(now, current, result))
    new_history = History(
        current_replicas=result,
        recommendations=tuple(r for r in recommendations if r.at >= keep_after),
        events=tuple(e for e in events if e.at >= keep_after),
        panic_until=panic_until,
        last_active_at=last_active,
    )
    verb = "keep" if result == current else ("scale up" if result > current else "scale down")
    reason = f"{verb} {current} -> {result}: " + "; ".join(notes)
    return Decision(
        replicas=result,
        mode="panic" if in_panic else "stable",
        reason=reason,
        current=current,
        stable_desired=stable_desired,
        panic_desired=panic_desired,
        in_flight=latest.in_flight,
        history=new_history,
        hold_until=hold_until,
    )


def _recommended(rec: Recommendation) -> str:
    return "set by hand" if rec.manual else "recommended"


def manual_replicas(
    requested: int, config: AutoscalerConfig, history: History, now: float, in_flight: float = 0.0
) -> Decision:
    """A count set by hand through the scale subresource (``kubectl scale``, or a gateway waking the
    fleet from zero): applied at once, clamped to [max(minReplicas, 1), maxReplicas] (0 only with scale
    to zero on), and recorded as a recommendation at ``now``, so that `desired_replicas` lowers it only
    once ``scale_down.stabilization_window_s`` has passed with the load asking for fewer (HPA v2's
    scale-down window). A count above zero is activity too: the scale-to-zero grace period starts again
    from ``now``. ``history.current_replicas`` is the size before (the caller's view of the truth)."""
    to_zero = config.idles_to_zero and requested <= 0
    replicas = 0 if to_zero else max(config.floor, min(config.max_replicas, int(requested)))
    current = history.current_replicas if history.current_replicas is not None else replicas
    notes = [f"spec.replicas set to {requested} by hand (kubectl scale, or a gateway waking the fleet)"]
    if replicas != requested:
        notes.append(f"clamped to [{config.floor}, {config.max_replicas}]")
    window = config.scale_down.stabilization_window_s
    if window > 0 and replicas > 0:
        notes.append(f"not scaled below {replicas} before the {window:g}s scale-down window has passed")
    keep_after = now - config.longest_window_s
    recommendations = (*history.recommendations, Recommendation(now, replicas, manual=True))
    new_history = replace(
        history,
        current_replicas=replicas,
        recommendations=tuple(r for r in recommendations if r.at >= keep_after),
        last_active_at=now if replicas > 0 else history.last_active_at,
    )
    verb = "keep" if replicas == current else ("scale up" if replicas > current else "scale down")
    return Decision(
        replicas=replicas,
        mode="manual",
        reason=f"{verb} {current} -> {replicas}: " + "; ".join(notes),
        current=current,
        stable_desired=replicas,
        panic_desired=replicas,
        in_flight=in_flight,
        history=new_history,
    )


def trim_observations(
    observations: Sequence[Observation], config: AutoscalerConfig, now: float
) -> list[Observation]:
    """Drop samples no window can see any more, so a long-running daemon keeps bounded memory."""
    keep_after = now - max(config.stable_window_s, config.panic_window_s)
    return [o for o in observations if o.timestamp > keep_after]


def _rules_from_spec(spec: Mapping[str, Any] | None, default: ScalingRules) -> ScalingRules:
    if not spec:
        return default
    # As in HPA v2: naming any rate policy replaces the default policies rather than adding to them.
    own_policy = spec.get("maxPercentPerPeriod") is not None or spec.get("maxPodsPerPeriod") is not None
    return ScalingRules(
        stabilization_window_s=float(spec.get("stabilizationWindowSeconds", default.stabilization_window_s)),
        max_percent=_opt_float(spec.get("maxPercentPerPeriod") if own_policy else default.max_percent),
        max_pods=_opt_int(spec.get("maxPodsPerPeriod") if own_policy else default.max_pods),
        period_s=float(spec.get("periodSeconds", default.period_s)),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def from_spec(spec: Mapping[str, Any] | None, in_flight_per_replica: int | None = None) -> AutoscalerConfig:
    """Build the config from an EmbeddingDeployment's camelCase ``spec.autoscaling``.

    ``in_flight_per_replica`` is the target `autoscale_target.in_flight_target` chose for the whole spec
    (it may borrow spec.runtime.maxBatchRequests); None reads ``inFlightPerReplica`` here, else 32.
    Missing keys take the defaults above (the CRD schema carries the same defaults, so a spec that went
    through the API server is already complete). Raises ValueError naming the field on nonsense.
    """
    spec = dict(spec or {})
    base = AutoscalerConfig()
    stz = spec.get("scaleToZero")
    if isinstance(stz, Mapping):
        scale_to_zero = bool(stz.get("enabled", False))
        grace = float(stz.get("graceSeconds", base.scale_to_zero_grace_s))
    else:
        scale_to_zero = bool(stz) if stz is not None else base.scale_to_zero
        grace = float(spec.get("scaleToZeroGraceSeconds", base.scale_to_zero_grace_s))
    return AutoscalerConfig(
        min_replicas=int(spec.get("minReplicas", base.min_replicas)),
        max_replicas=int(spec.get("maxReplicas", base.max_replicas)),
        in_flight_per_replica=int(next(
            v for v in (in_flight_per_replica, spec.get("inFlightPerReplica"), base.in_flight_per_replica)
            if v is not None
        )),
        target_utilization=float(spec.get("targetUtilization", base.target_utilization)),
        stable_window_s=float(spec.get("stableWindowSeconds", base.stable_window_s)),
        panic_window_s=float(spec.get("panicWindowSeconds", base.panic_window_s)),
        panic_threshold=float(spec.get("panicThreshold", base.panic_threshold)),
        scale_up=_rules_from_spec(spec.get("scaleUp"), DEFAULT_SCALE_UP),
        scale_down=_rules_from_spec(spec.get("scaleDown"), DEFAULT_SCALE_DOWN),
        tolerance=float(spec.get("tolerance", base.tolerance)),
        scale_to_zero=scale_to_zero,
        scale_to_zero_grace_s=grace,
    )
