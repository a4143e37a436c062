"""The autoscaler's policy: worked examples first, then the invariants hypothesis hunts for breaks in."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedfleet.operator.autoscale import (
    AutoscalerConfig,
    Decision,
    History,
    Observation,
    Recommendation,
    ScalingRules,
    desired_replicas,
    from_spec,
    manual_replicas,
    trim_observations,
)

NO_LIMITS = ScalingRules(stabilization_window_s=0, max_percent=None, max_pods=None)


def cfg(**kw: object) -> AutoscalerConfig:
    base: dict[str, object] = {
        "in_flight_per_replica": 32,
        "target_utilization": 1.0,
        "scale_up": NO_LIMITS,
        "scale_down": NO_LIMITS,
    }
    base.update(kw)
    return AutoscalerConfig(**base)  # type: ignore[arg-type]


def steady(load: float, now: float = 100.0, span: float = 60.0, step: float = 2.0) -> list[Observation]:
    """A constant load sampled every `step` seconds over the last `span` seconds."""
    n = int(span / step)
    return [Observation(now - span + (i + 1) * step, load, 1) for i in range(n)]


# ---------------------------------------------------------------- worked examples (table)

EXAMPLES = [
    # (what, config, observations, history, expected replicas, expected mode)
    ("design example: batch 32, utilisation 1.0, 50 in flight -> 2",
     cfg(), steady(50), History(2), 2, "stable"),
    ("same example from one replica is a burst (panic) -> 2", cfg(), steady(50), History(1), 2, "panic"),
    ("utilisation 0.5 halves the target: 50 / 16 -> 4", cfg(target_utilization=0.5), steady(50), History(4),
     4, "stable"),
    ("idle, min 1, no scale-down window -> 1", cfg(), steady(0), History(3), 1, "stable"),
    ("idle with scale-to-zero off never reaches 0", cfg(min_replicas=0), steady(0, span=600), History(1), 1,
     "stable"),
    ("idle past the grace with scale-to-zero on -> 0",
     cfg(scale_to_zero=True, scale_to_zero_grace_s=30), steady(0), History(1, last_active_at=0.0), 0,
     "stable"),
    ("huge load clamps to max", cfg(max_replicas=5), steady(10_000), History(5), 5, "panic"),
    ("tolerance band keeps 4 at 6% over target (target 22.4)",
     cfg(target_utilization=0.7), steady(95), History(4), 4, "stable"),
    ("outside the band it moves: 120 / 22.4 -> 6", cfg(target_utilization=0.7, panic_threshold=10),
     steady(120), History(4), 6, "stable"),
    ("scale-up rate limit: from 2, max(100%, 4 pods) -> 6",
     cfg(panic_threshold=100, scale_up=ScalingRules(max_percent=100, max_pods=4, period_s=15)),
     steady(640), History(2), 6, "stable"),
    ("scale-down rate limit: 10 -> at most 50% off -> 5",
     cfg(scale_down=ScalingRules(max_percent=50, period_s=15)), steady(0), History(10), 5, "stable"),
    ("scale-down stabilization holds the highest recent recommendation",
     cfg(scale_down=ScalingRules(stabilization_window_s=300)), steady(40),
     History(5, recommendations=(Recommendation(50.0, 5),)), 5, "stable"),
    ("never below what in-flight work needs: latest 100 in flight / 32 -> 4",
     cfg(panic_threshold=1000),
     [*steady(0, now=99, span=58), Observation(100.0, 100, 1)], History(6), 4, "stable"),
    ("scale from zero on requests held by the gateway",
     cfg(scale_to_zero=True), [Observation(100.0, 0, 0, queue_depth=5)], History(0), 1, "stable"),
]


@pytest.mark.parametrize(("what", "config", "obs", "history", "expected", "mode"), EXAMPLES,
                         ids=[e[0] for e in EXAMPLES])
def test_worked_examples(what: str, config: AutoscalerConfig, obs: list[Observation], history: History,
                         expected: int, mode: str) -> None:
    decision = desired_replicas(obs, config, history, now=100.0)
    assert decision.replicas == expected, decision.reason
    assert decision.mode == mode, decision.reason
    assert decision.reason.startswith(("keep", "scale up", "scale down"))
    assert decision.history.current_replicas == expected


def test_no_observations_keeps_current() -> None:
    decision = desired_replicas([], cfg(), History(3), now=10.0)
    assert decision.replicas == 3
    assert "no observations" in decision.reason


def test_scale_up_rate_limit_counts_the_whole_period() -> None:
    """Two ticks inside one 15 s period may together add at most 4 pods from the period's start."""
    config = cfg(panic_threshold=100, scale_up=ScalingRules(max_pods=4, period_s=15))
    first = desired_replicas(steady(1000, now=100), config, History(2), now=100.0)
    assert first.replicas == 6
    second = desired_replicas(steady(1000, now=105), config, first.history, now=105.0)
    assert second.replicas == 6, second.reason
    third = desired_replicas(steady(1000, now=116), config, second.history, now=116.0)
    assert third.replicas == 10, third.reason


def test_panic_never_shrinks_until_stable_window_passes() -> None:
    config = cfg(stable_window_s=60, panic_window_s=6, panic_threshold=2)
    burst = desired_replicas(steady(320, now=100, span=6, step=1), config, History(2), now=100.0)
    assert burst.mode == "panic" and burst.replicas == 10
    calm = desired_replicas(steady(0, now=130, span=30, step=1), config, burst.history, now=130.0)
    assert calm.mode == "panic" and calm.replicas == 10, calm.reason
    later = desired_replicas(steady(0, now=170, span=60, step=1), config, calm.history, now=170.0)
    assert later.mode == "stable" and later.replicas == 1, later.reason


def test_scale_to_zero_waits_for_the_grace_period() -> None:
    config = cfg(scale_to_zero=True, scale_to_zero_grace_s=30)
    busy = desired_replicas([Observation(100, 5, 1)], config, History(1), now=100.0)
    early = desired_replicas([Observation(120, 0, 1)], config, busy.history, now=120.0)
    assert early.replicas == 1 and "scale to zero after" in early.reason
    late = desired_replicas([Observation(131, 0, 1)], config, early.history, now=131.0)
    assert late.replicas == 0


def test_traffic_a_gateway_saw_between_ticks_keeps_the_fleet_from_zero() -> None:
    """Queries of a few milliseconds read as 0 in flight at every tick; the gateway's last request time
    is what says the deployment is in use."""
    config = cfg(scale_to_zero=True, scale_to_zero_grace_s=30)
    busy = desired_replicas([Observation(100, 5, 1)], config, History(1), now=100.0)
    seen = desired_replicas([Observation(131, 0, 1, last_request_at=125.0)], config, busy.history, now=131.0)
    assert seen.replicas == 1 and "scale to zero after" in seen.reason
    idle = desired_replicas([Observation(156, 0, 1, last_request_at=125.0)], config, seen.history, now=156.0)
    assert idle.replicas == 0, idle.reason


def test_a_fleet_at_zero_with_no_load_stays_at_zero() -> None:
    """Fresh (rendered at zero) or scaled to zero: only load (requests held by a gateway) or a wake
    through the scale subresource starts a replica, whatever the grace period or a gateway's silence."""
    config = cfg(scale_to_zero=True, scale_to_zero_grace_s=3600, min_replicas=0)
    fresh = desired_replicas([Observation(10, 0, 0)], config, History(0), now=10.0)
    assert fresh.replicas == 0, fresh.reason
    unknown = desired_replicas([Observation(11, 0, 0, activity_unknown=True)], config, fresh.history, now=11.0)
    assert unknown.replicas == 0, unknown.reason
    held = desired_replicas([Observation(12, 0, 0, queue_depth=3)], config, unknown.history, now=12.0)
    assert held.replicas == 1, held.reason


def test_no_scale_to_zero_while_a_gateway_cannot_say_whether_traffic_came() -> None:
    config = cfg(scale_to_zero=True, scale_to_zero_grace_s=30)
    busy = desired_replicas([Observation(100, 5, 1)], config, History(1), now=100.0)
    unknown = desired_replicas([Observation(200, 0, 1, activity_unknown=True)], config, busy.history, now=200.0)
    assert unknown.replicas == 1 and "did not say" in unknown.reason
    known = desired_replicas([Observation(201, 0, 1)], config, unknown.history, now=201.0)
    assert known.replicas == 0, known.reason


def test_requests_held_by_a_gateway_wake_a_fleet_at_zero() -> None:
    config = cfg(scale_to_zero=True, scale_to_zero_grace_s=30)
    woken = desired_replicas([Observation(100, 0, 0, queue_depth=3, last_request_at=100.0)], config, History(0),
                             now=100.0)
    assert woken.replicas == 1, woken.reason


def test_trim_observations_keeps_only_visible_samples() -> None:
    config = cfg(stable_window_s=60, panic_window_s=6)
    kept = trim_observations(steady(1, now=200, span=200), config, now=200.0)
    assert kept and all(o.timestamp > 140 for o in kept)


def test_from_spec_reads_the_crd_fields() -> None:
    config = from_spec(
        {
            "minReplicas": 2,
            "maxReplicas": 8,
            "targetUtilization": 0.5,
            "stableWindowSeconds": 30,
            "panicWindowSeconds": 3,
            "panicThreshold": 3,
            "scaleUp": {"stabilizationWindowSeconds": 5, "maxPodsPerPeriod": 2, "periodSeconds": 10},
            "scaleDown": {"stabilizationWindowSeconds": 20, "maxPercentPerPeriod": 25, "periodSeconds": 30},
            "tolerance": 0.05,
            "scaleToZero": True,
        },
        in_flight_per_replica=16,
    )
    assert (config.min_replicas, config.max_replicas, config.in_flight_per_replica) == (2, 8, 16)
    assert config.target_per_replica == 8
    assert (config.stable_window_s, config.panic_window_s, config.panic_threshold) == (30, 3, 3)
    assert config.scale_up == ScalingRules(5, None, 2, 10)
    assert config.scale_down == ScalingRules(20, 25, None, 30)
    assert config.tolerance == 0.05 and config.scale_to_zero


def test_from_spec_defaults_and_errors() -> None:
    assert from_spec({}, 32) == AutoscalerConfig(in_flight_per_replica=32)
    assert from_spec(None, 32).scale_up.max_pods == 4
    with pytest.raises(ValueError, match=r"minReplicas \(5\) > maxReplicas \(2\)"):
        from_spec({"minReplicas": 5, "maxReplicas": 2}, 32)
    with pytest.raises(ValueError, match="targetUtilization"):
        from_spec({"targetUtilization": 0}, 32)


# ---------------------------------------------------------------- properties

rules = st.builds(
    ScalingRules,
    stabilization_window_s=st.sampled_from([0.0, 10.0, 60.0]),
    max_percent=st.one_of(st.none(), st.sampled_from([10.0, 50.0, 100.0, 200.0])),
    max_pods=st.one_of(st.none(), st.integers(1, 5)),
    period_s=st.sampled_from([5.0, 15.0, 60.0]),
)


@st.composite
def configs(draw: st.DrawFn) -> AutoscalerConfig:
    lo = draw(st.integers(0, 5))
    hi = draw(st.integers(max(lo, 1), 40))
    stable = draw(st.sampled_from([10.0, 30.0, 60.0]))
    return AutoscalerConfig(
        min_replicas=lo,
        max_replicas=hi,
        in_flight_per_replica=draw(st.sampled_from([1, 8, 32, 64])),
        target_utilization=draw(st.sampled_from([0.3, 0.5, 0.7, 1.0])),
        stable_window_s=stable,
        panic_window_s=draw(st.sampled_from([1.0, 3.0, stable])),
        panic_threshold=draw(st.sampled_from([1.0, 2.0, 4.0])),
        scale_up=draw(rules),
        scale_down=draw(rules),
        tolerance=draw(st.sampled_from([0.0, 0.1, 0.3])),
        scale_to_zero=draw(st.booleans()),
        scale_to_zero_grace_s=draw(st.sampled_from([0.0, 5.0, 30.0])),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[AutoscalerConfig, list[Observation], History, float]:
    config = draw(configs())
    now = 1000.0
    loads = draw(st.lists(st.integers(0, 3000), min_size=1, max_size=20))
    gaps = draw(st.lists(st.sampled_from([0.5, 1.0, 3.0, 10.0]), min_size=len(loads), max_size=len(loads)))
    t, obs = now, []
    for load, gap in zip(reversed(loads), gaps, strict=True):
        obs.append(Observation(t, float(load), 1))
        t -= gap
    obs.reverse()
    current = draw(st.integers(config.floor, config.max_replicas))
    recs = draw(st.lists(st.tuples(st.floats(now - 100, now - 1), st.integers(0, config.max_replicas)),
                         max_size=4))
    history = History(
        current_replicas=current,
        recommendations=tuple(Recommendation(a, r) for a, r in sorted(recs)),
        panic_until=draw(st.sampled_from([None, now - 5, now + 5])),
        last_active_at=draw(st.sampled_from([None, now - 100, now - 1])),
    )
    return config, obs, history, now


PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(scenarios(), st.floats(1.0, 10.0))
def test_monotone_in_load(s: tuple[AutoscalerConfig, list[Observation], History, float], k: float) -> None:
    config, obs, history, now = s
    more = [Observation(o.timestamp, o.in_flight * k, o.ready_pods) for o in obs]
    low = desired_replicas(obs, config, history, now)
    high = desired_replicas(more, config, history, now)
    assert high.replicas >= low.replicas, (low.reason, high.reason)


@PROPS
@given(scenarios())
def test_respects_bounds(s: tuple[AutoscalerConfig, list[Observation], History, float]) -> None:
    config, obs, history, now = s
    decision = desired_replicas(obs, config, history, now)
    assert decision.replicas <= config.max_replicas
    if decision.replicas == 0:
        assert config.scale_to_zero, decision.reason
        assert obs[-1].load == 0
    else:
        assert decision.replicas >= config.floor


@PROPS
@given(scenarios())
def test_respects_rate_limits(s: tuple[AutoscalerConfig, list[Observation], History, float]) -> None:
    config, obs, history, now = s
    current = history.current_replicas
    assert current is not None
    decision = desired_replicas(obs, config, history, now)
    up, down = config.scale_up, config.scale_down
    if up.limited and decision.replicas > current:
        allowed = max(
            up.max_pods or 0,
            math.ceil(current * (up.max_percent or 0) / 100.0),
            1,
        )
        assert decision.replicas - current <= allowed, decision.reason
    if down.limited and decision.replicas < current:
        allowed = max(
            down.max_pods or 0,
            current - math.floor(current * (1 - (down.max_percent or 0) / 100.0)),
        )
        assert current - decision.replicas <= allowed, decision.reason


@PROPS
@given(scenarios())
def test_never_below_in_flight_need(s: tuple[AutoscalerConfig, list[Observation], History, float]) -> None:
    config, obs, history, now = s
    current = history.current_replicas
    assert current is not None
    decision = desired_replicas(obs, config, history, now)
    need = min(math.ceil(obs[-1].in_flight / config.in_flight_per_replica), config.max_replicas)
    if decision.replicas < current:
        assert decision.replicas >= need, decision.reason


@PROPS
@given(configs(), st.integers(0, 2000), st.integers(0, 40),
       st.lists(st.sampled_from([1.0, 2.0, 5.0]), min_size=30, max_size=80))
def test_no_flapping_on_a_constant_signal(
    config: AutoscalerConfig, load: int, start: int, gaps: list[float]
) -> None:
    """Under a constant load the fleet moves in one direction, then stays put."""
    current = min(max(start, config.floor), config.max_replicas)
    history, obs, now, seen = History(current), [], 0.0, [current]
    for gap in gaps:
        now += gap
        sample = Observation(now, float(load), history.current_replicas or 0)
        obs = trim_observations([*obs, sample], config, now)
        decision = desired_replicas(obs, config, history, now)
        history = decision.history
        seen.append(decision.replicas)
    steps = [b - a for a, b in itertools.pairwise(seen) if b != a]
    assert all(x > 0 for x in steps) or all(x < 0 for x in steps), seen


@PROPS
@given(scenarios())
def test_is_pure(s: tuple[AutoscalerConfig, list[Observation], History, float]) -> None:
    """Same inputs, same decision; the input history is left as it was."""
    config, obs, history, now = s
    before = History(**history.__dict__)
    first = desired_replicas(obs, config, history, now)
    second = desired_replicas(obs, config, history, now)
    assert first == second
    assert history == before


def test_gateway_reports_fold_into_held_requests_and_the_newest_traffic() -> None:
    from embedfleet.operator.gateway_signal import combine

    key = "team-a/bge"
    reports = [
        {"deployments": {key: {"held": 2, "in_flight": 3, "last_request_age_s": 4.0}, "other/x": {"held": 9}}},
        {"deployments": {key: {"held": 1, "last_request_age_s": 0.5}}},
        {"deployments": {}},
    ]
    reading = combine(reports, key)
    assert (reading.held, reading.last_request_age_s, reading.gateways, reading.unknown) == (3.0, 0.5, 3, False)
    assert combine([{"deployments": {}}], key).last_request_age_s is None, "no traffic seen is not traffic"
    broken = combine([*reports, "gw-2: ConnectError: refused"], key)
    assert broken.unknown and broken.held == 3.0


# ---------------------------------------------------------------- manual scaling and minReplicas

IDLE_WINDOW = ScalingRules(stabilization_window_s=30, max_percent=None, max_pods=None)


def idle_ticks(config: AutoscalerConfig, history: History, start: float, end: float, step: float = 5.0,
               ) -> list[Decision]:
    """The decisions of ticks every `step` seconds in (start, end] with no load at all."""
    out: list[Decision] = []
    now, obs = start, []
    while now + step <= end:
        now += step
        obs = trim_observations([*obs, Observation(now, 0.0, history.current_replicas or 0)], config, now)
        decision = desired_replicas(obs, config, history, now)
        history = decision.history
        out.append(decision)
    return out


def at(ticks: list[Decision], start: float, step: float = 5.0) -> dict[float, int]:
    """{tick time: replicas} for `idle_ticks(..., start, ..., step)`."""
    return {start + step * (i + 1): d.replicas for i, d in enumerate(ticks)}


def test_kubectl_scale_is_held_for_the_scale_down_window() -> None:
    """1 replica, idle; `kubectl scale --replicas=2` at t=100 with a 30 s scale-down window: 2 until the
    window has passed, then 1 — not at the next tick."""
    config = cfg(scale_down=IDLE_WINDOW)
    settled = desired_replicas(steady(0), config, History(1), now=100.0)
    manual = manual_replicas(2, config, settled.history, now=100.0)
    assert (manual.replicas, manual.mode, manual.changed) == (2, "manual", True)
    assert "not scaled below 2 before the 30s scale-down window" in manual.reason
    ticks = idle_ticks(config, manual.history, 100.0, 140.0)
    assert at(ticks, 100.0) == {105.0: 2, 110.0: 2, 115.0: 2, 120.0: 2, 125.0: 2, 130.0: 2, 135.0: 1, 140.0: 1}
    held = ticks[0]
    assert held.hold_until == 130.0 and not held.changed
    assert "holds 2 for 25s more (2 set by hand 5s ago; the load alone asks for 1)" in held.reason
    assert all(d.hold_until == 130.0 for d in ticks[:6])
    down = ticks[6]
    assert down.changed and down.hold_until is None
    assert "scale-down window 30s passed since 2 was last set by hand (35s ago)" in down.reason


def test_a_manual_count_lowered_by_another_write_goes_back_within_the_window() -> None:
    """The Deployment set back to 1 by a write racing the resize (the caller reports 1): the count set by
    hand is restored while its window lasts, and not after it."""
    config = cfg(scale_down=IDLE_WINDOW)
    manual = manual_replicas(2, config, desired_replicas(steady(0), config, History(1), now=100.0).history,
                             now=100.0)
    back = desired_replicas(steady(0, now=105), config, manual.history.with_current(1), now=105.0)
    assert (back.current, back.replicas) == (1, 2), back.reason
    assert "2 set by hand 5s ago holds for the 30s scale-down window" in back.reason
    late = desired_replicas(steady(0, now=131), config, back.history.with_current(1), now=131.0)
    assert late.replicas == 1, late.reason


def test_load_scales_up_from_a_manual_count_at_once_even_with_a_scale_up_window() -> None:
    """A count set by hand is not a recommendation of the scale-up window: scaled down to 1 by hand
    while the load asks for 3, the fleet goes back to 3 at the next tick."""
    config = cfg(panic_threshold=100, scale_up=ScalingRules(stabilization_window_s=60), scale_down=IDLE_WINDOW)
    busy = desired_replicas(steady(96, now=90), config, History(3), now=90.0)
    assert busy.replicas == 3
    manual = manual_replicas(1, config, busy.history, now=95.0)
    assert manual.replicas == 1
    back = desired_replicas(steady(96), config, manual.history, now=100.0)
    assert back.replicas == 3, back.reason


def test_a_manual_scale_down_is_not_undone_by_older_recommendations() -> None:
    config = cfg(scale_down=ScalingRules(stabilization_window_s=300))
    history = History(3, recommendations=(Recommendation(80.0, 3), Recommendation(90.0, 3)))
    manual = manual_replicas(1, config, history, now=95.0)
    later = desired_replicas(steady(0), config, manual.history, now=100.0)
    assert later.replicas == 1 and later.hold_until is None, later.reason


def test_manual_counts_are_clamped_like_the_autoscalers_own() -> None:
    config = cfg(min_replicas=2, max_replicas=4, scale_down=IDLE_WINDOW)
    assert manual_replicas(9, config, History(2), now=1.0).replicas == 4
    assert manual_replicas(1, config, History(2), now=1.0).replicas == 2
    assert "clamped to [2, 4]" in manual_replicas(9, config, History(2), now=1.0).reason
    assert manual_replicas(0, cfg(min_replicas=0), History(1), now=1.0).replicas == 1  # zero needs scale to zero
    to_zero = cfg(min_replicas=2, scale_to_zero=True)
    assert manual_replicas(0, to_zero, History(2), now=1.0).replicas == 0
    assert manual_replicas(1, to_zero, History(0), now=1.0).replicas == 2


def test_lowering_min_replicas_waits_for_the_scale_down_window() -> None:
    """minReplicas 2 -> 1 at t=100 (the last tick under 2 was at t=100): 2 until t=130, then 1."""
    before = cfg(min_replicas=2, scale_down=IDLE_WINDOW)
    history = idle_ticks(before, History(2), 50.0, 100.0)[-1].history
    assert history.current_replicas == 2
    after = cfg(min_replicas=1, scale_down=IDLE_WINDOW)
    ticks = idle_ticks(after, history, 100.0, 140.0)
    assert at(ticks, 100.0) == {105.0: 2, 110.0: 2, 115.0: 2, 120.0: 2, 125.0: 2, 130.0: 2, 135.0: 1, 140.0: 1}
    assert "scale-down window 30s passed since 2 was last recommended (35s ago)" in ticks[6].reason


def test_raising_min_replicas_scales_up_at_once() -> None:
    before = cfg(min_replicas=1, scale_down=IDLE_WINDOW)
    history = idle_ticks(before, History(1), 50.0, 100.0)[-1].history
    after = cfg(min_replicas=2, scale_up=ScalingRules(stabilization_window_s=60), scale_down=IDLE_WINDOW)
    assert desired_replicas(steady(0, now=105), after, history, now=105.0).replicas == 2


def test_a_wake_from_zero_is_held_for_the_window_and_the_grace_period() -> None:
    """A gateway (or a person) sets the scale to 1 while the fleet is at zero and no request comes: the
    wake counts as activity, so neither the scale-down window nor the grace period is cut short."""
    for window, grace in ((30.0, 10.0), (10.0, 30.0)):
        config = cfg(min_replicas=0, scale_to_zero=True, scale_to_zero_grace_s=grace,
                     scale_down=ScalingRules(stabilization_window_s=window))
        at_zero = desired_replicas([Observation(50.0, 0, 0)], config, History(0, last_active_at=0.0), now=50.0)
        assert at_zero.replicas == 0
        woken = manual_replicas(1, config, at_zero.history, now=100.0)
        assert woken.replicas == 1 and woken.history.last_active_at == 100.0
        ticks = at(idle_ticks(config, woken.history, 100.0, 150.0), 100.0)
        assert [r for t, r in ticks.items() if t <= 100 + max(window, grace)] == [1] * 6, ticks
        assert ticks[150.0] == 0, ticks  # (the grace period's own recommendations of 1 count in the window)


def test_status_says_a_hold_once_with_its_end_in_wall_clock_time() -> None:
    """The daemon's part: the hold goes to status.lastScaleDecision once (not every tick it lasts), its
    reason led by when it ends as a UTC time; the scale-down that ends it needs no extra record."""
    from datetime import UTC, datetime, timedelta

    from embedfleet.operator.handlers import autoscale_daemon as daemon

    config = cfg(scale_down=IDLE_WINDOW)
    manual = manual_replicas(2, config, desired_replicas(steady(0), config, History(1), now=100.0).history,
                             now=100.0)
    ticks = idle_ticks(config, manual.history, 100.0, 145.0)
    state = daemon.LoopState()
    assert daemon.hold_is_news(manual, state, 100.0) is False
    news = [daemon.hold_is_news(d, state, t) for t, d in zip(at(ticks, 100.0), ticks, strict=True)]
    assert news == [True] + [False] * 8
    assert state.announced_hold is None  # the scale-down at t=135 ended it

    before = datetime.now(UTC)
    reason = daemon.explain(ticks[0], now=105.0)
    prefix = "ScaleDownStabilizing: holding 2 replicas until "
    assert reason.startswith(prefix) and reason.endswith(ticks[0].reason)
    until = datetime.strptime(reason[len(prefix):len(prefix) + 20], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert before + timedelta(seconds=24) <= until <= datetime.now(UTC) + timedelta(seconds=26)
    assert daemon.explain(ticks[6], now=135.0) == ticks[6].reason


def test_the_deployment_is_resized_once_the_watch_shows_the_new_status() -> None:
    """The daemon's wait between its status write and its Deployment write: it returns as soon as kopf's
    view reads the new desired count, and gives up (resizing anyway) after its bound."""
    from embedfleet.operator.handlers import autoscale_daemon as daemon

    views = iter([1, 1, None, 2])
    assert daemon._await_visible(lambda: next(views), 2, "ns/x", timeout=5.0) is True
    assert next(views, "drained") == "drained"
    assert daemon._await_visible(lambda: 1, 2, "ns/x", timeout=0.1) is False


# A series of ticks: seconds between them, whether a gateway said it could not tell about traffic, and a
# lower size some other write set the Deployment to just before the tick (None: it kept the decided size).
idle_series = st.lists(st.tuples(st.sampled_from([0.5, 1.0, 3.0, 5.0, 10.0]), st.booleans(),
                                 st.one_of(st.none(), st.integers(0, 40))),
                       min_size=1, max_size=40)


@PROPS
@given(configs(), st.sampled_from([5.0, 20.0, 30.0, 300.0]), st.integers(0, 40), st.integers(0, 40),
       st.lists(st.tuples(st.floats(0, 99), st.integers(0, 40)), max_size=4), idle_series)
def test_a_manual_count_is_never_lowered_before_the_window_with_no_load(
    config: AutoscalerConfig, window: float, before: int, requested: int,
    old: list[tuple[float, int]], series: list[tuple[float, bool, int | None]],
) -> None:
    """Whatever the settings, the history, the ticks and other writes to the Deployment: with no load,
    the count set by hand at t=100 is never lowered while t <= 100 + scaleDown.stabilizationWindowSeconds
    (a lower size written by someone else goes back); at the first tick after it, an idle fleet above
    what idleness asks for is lower."""
    config = AutoscalerConfig(**{**config.__dict__,
                                 "scale_down": ScalingRules(window, config.scale_down.max_percent,
                                                            config.scale_down.max_pods, config.scale_down.period_s)})
    before = min(before, config.max_replicas)
    history = History(before, recommendations=tuple(Recommendation(a, min(r, config.max_replicas))
                                                    for a, r in sorted(old)), last_active_at=0.0)
    manual = manual_replicas(requested, config, history, now=100.0)
    kept = manual.replicas
    history, now, obs = manual.history, 100.0, []
    held_by_ticks = False  # a tick inside the window itself recommended `kept` (the window then runs on)
    for gap, unknown, other in series:
        now += gap
        if other is not None and now <= 100.0 + window:
            history = history.with_current(min(other, kept))  # a racing write of an older, lower size
        obs = trim_observations([*obs, Observation(now, 0.0, history.current_replicas or 0,
                                                   activity_unknown=unknown)], config, now)
        decision = desired_replicas(obs, config, history, now)
        history = decision.history
        if now <= 100.0 + window:
            assert decision.replicas >= kept, decision.reason
            if decision.replicas == decision.current == kept > config.floor:  # idleness asks for less
                assert decision.hold_until is not None and decision.hold_until <= 100.0 + window, decision.reason
            held_by_ticks |= history.recommendations[-1].replicas >= kept
        else:
            # Lower at the first tick after the window, unless idleness asks for `kept` too, a tick in the
            # window recommended it, or a rate-limited walk to zero stops at the floor first.
            idle = config.floor if kept > 0 and (unknown or not config.scale_to_zero
                                                 or now - 100.0 < config.scale_to_zero_grace_s) else 0
            walk = idle == 0 and kept == config.floor and config.scale_down.limited
            if kept > idle and not held_by_ticks and not walk:
                assert decision.replicas < kept, decision.reason
            break


@PROPS
@given(st.integers(1, 5), st.integers(0, 4), st.sampled_from([10.0, 30.0]), idle_series)
def test_lowering_min_replicas_never_removes_a_pod_before_the_window(
    high: int, lower_by: int, window: float, series: list[tuple[float, bool, int | None]]
) -> None:
    rules = ScalingRules(window, 100.0, None, 15.0)
    old = cfg(min_replicas=high, max_replicas=10, scale_down=rules)
    new = cfg(min_replicas=max(high - lower_by, 0), max_replicas=10, scale_down=rules)
    history = idle_ticks(old, History(high), 0.0, 100.0)[-1].history  # the last tick under the old min: t=100
    assert history.current_replicas == high
    now, obs = 100.0, []
    for gap, _, _ in series:
        now += gap
        obs = [Observation(now, 0.0, history.current_replicas or 0)]
        decision = desired_replicas(obs, new, history, now)
        history = decision.history
        if now <= 100.0 + window:
            assert decision.replicas == high, decision.reason
        else:
            assert decision.replicas == new.floor, decision.reason
            break
