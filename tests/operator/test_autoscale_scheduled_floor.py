"""The autoscaler with a scheduled floor (an open window raises it, wakes a fleet at zero, and lets go
through the scale-down window), the hub's fleet target with one, admission of schedule entries, and the
scale-up that jumps: from held demand, one decision asks for what the demand needs, bounded by the surge."""

from __future__ import annotations

import copy
import dataclasses
import math
from datetime import UTC, datetime
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from embedfleet.operator.autoscale import (
    AutoscalerConfig,
    History,
    Observation,
    ScalingRules,
    desired_replicas,
    manual_replicas,
)
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.handlers.autoscale_daemon import with_schedule
from embedfleet.operator.hub.autoscale import fleet_target
from embedfleet.operator.validate import check

DIGEST = "sha256:" + "0f" * 32
PEAK = {"name": "peak", "start": "0 8 * * 1-5", "end": "0 18 * * 1-5", "timezone": "Europe/Berlin",
        "minReplicas": 3}
IN_PEAK = datetime(2026, 3, 9, 12, 0, tzinfo=UTC)  # a Monday, 13:00 in Berlin
AFTER_PEAK = datetime(2026, 3, 9, 20, 0, tzinfo=UTC)


def spec(**autoscaling: Any) -> dict[str, Any]:
    return {"model": {"source": "hf://BAAI/bge-small-en-v1.5", "digest": DIGEST},
            "autoscaling": copy.deepcopy(autoscaling)}


def idle(now: float, ready: int) -> list[Observation]:
    return [Observation(now, 0.0, ready)]


def scheduled(config: AutoscalerConfig, floor: int, by: str = "schedule peak") -> AutoscalerConfig:
    return dataclasses.replace(config, scheduled_floor=floor, scheduled_by=by)


def test_an_open_window_raises_the_floor_and_the_reason_names_it() -> None:
    config = scheduled(AutoscalerConfig(min_replicas=1, max_replicas=10), 3)
    decision = desired_replicas(idle(100.0, 1), config, History(current_replicas=1), 100.0)
    assert decision.replicas == 3
    assert "schedule peak keeps at least 3" in decision.reason, decision.reason


def test_the_floor_never_passes_max_replicas() -> None:
    config = scheduled(AutoscalerConfig(min_replicas=1, max_replicas=4), 9)
    assert config.floor == 4
    assert desired_replicas(idle(100.0, 1), config, History(current_replicas=1), 100.0).replicas == 4


def test_an_open_window_wakes_a_fleet_at_zero_and_keeps_it_from_idling_to_zero() -> None:
    base = AutoscalerConfig(min_replicas=0, scale_to_zero=True, scale_to_zero_grace_s=0.0)
    assert desired_replicas(idle(100.0, 0), base, History(current_replicas=0), 100.0).replicas == 0
    config = scheduled(base, 2)
    assert desired_replicas(idle(100.0, 0), config, History(current_replicas=0), 100.0).replicas == 2
    assert desired_replicas(idle(500.0, 2), config, History(current_replicas=2), 500.0).replicas == 2
    assert manual_replicas(0, config, History(current_replicas=2), 500.0).replicas == 2


def test_when_the_window_closes_the_scale_down_window_holds_then_lets_go() -> None:
    """No cliff: the raised count was recommended each tick, so the scale-down window holds it after the
    window closes and the fleet shrinks only once the window has passed."""
    base = AutoscalerConfig(min_replicas=1, scale_down=ScalingRules(stabilization_window_s=60.0))
    history, now = History(current_replicas=1), 0.0
    for now in (0.0, 5.0, 10.0):
        decision = desired_replicas(idle(now, history.current_replicas or 0), scheduled(base, 3), history, now)
        history = decision.history
    assert decision.replicas == 3
    closed = desired_replicas(idle(15.0, 3), base, history, 15.0)
    assert closed.replicas == 3 and closed.hold_until == 70.0, closed.reason
    assert desired_replicas(idle(69.0, 3), base, closed.history, 69.0).replicas == 3
    after = desired_replicas(idle(71.0, 3), base, closed.history, 71.0)
    assert after.replicas == 1, after.reason


@settings(max_examples=300, deadline=None)
@given(
    current=st.integers(0, 40),
    per_replica=st.integers(1, 64),
    utilization=st.sampled_from([0.5, 0.7, 1.0]),
    demand=st.floats(0, 20000, allow_nan=False),
    max_replicas=st.integers(1, 500),
    max_percent=st.one_of(st.none(), st.sampled_from([10.0, 50.0, 100.0, 400.0])),
    max_pods=st.one_of(st.none(), st.integers(1, 50)),
    held=st.booleans(),
)
def test_scale_up_asks_for_what_the_demand_needs_in_one_step_bounded_by_the_surge(
        current: int, per_replica: int, utilization: float, demand: float, max_replicas: int,
        max_percent: float | None, max_pods: int | None, held: bool) -> None:
    """From held (a gateway's, outside any pod) or queued (inside the pods) demand D, one decision asks for
    ceil(D / target), bounded by the surge (HPA v2: the most of maxPercent and maxPods per period, at least
    one) and maxReplicas; not one replica more than the current count."""
    rules = ScalingRules(max_percent=max_percent, max_pods=max_pods) if max_percent or max_pods else ScalingRules()
    config = AutoscalerConfig(min_replicas=0, max_replicas=max_replicas, in_flight_per_replica=per_replica,
                              target_utilization=utilization, tolerance=0.0, scale_to_zero=True, scale_up=rules)
    needed = math.ceil(round(demand / config.target_per_replica, 9))
    assume(current < needed and current <= max_replicas)  # a scale-up from a count within the bounds
    obs = [Observation(100.0, 0.0 if held else demand, current, queue_depth=demand if held else None)]
    decision = desired_replicas(obs, config, History(current_replicas=current), 100.0)
    if rules.limited:
        limits = ([math.ceil(current * (1 + max_percent / 100))] if max_percent is not None else []) + (
            [current + max_pods] if max_pods is not None else [])
        surge = max(*limits, current + 1)
    else:
        surge = 10**9
    assert decision.replicas == max(current, min(needed, surge, max_replicas)), decision.reason
    if min(needed, surge, max_replicas) > current + 1:
        assert decision.replicas > current + 1  # a jump, not a step


def test_the_hub_fleet_target_honours_an_open_window() -> None:
    parsed = EmbeddingDeploymentSpec.model_validate(spec(minReplicas=1, maxReplicas=10, schedule=[PEAK]))
    assert fleet_target(parsed, 0.0, 1, now=IN_PEAK) == 3
    assert fleet_target(parsed, None, 1, now=IN_PEAK) == 3
    assert fleet_target(parsed, 0.0, 3, now=AFTER_PEAK) == 1
    assert fleet_target(parsed, 1000.0, 3, now=IN_PEAK) == 10  # the load can still ask for more
    capped = EmbeddingDeploymentSpec.model_validate(spec(maxReplicas=2, schedule=[{**PEAK, "minReplicas": 2}]))
    assert fleet_target(capped, 0.0, 1, now=IN_PEAK) == 2


def test_the_daemon_applies_the_schedule_except_on_a_hubs_copy() -> None:
    parsed = EmbeddingDeploymentSpec.model_validate(spec(schedule=[PEAK]))
    base = AutoscalerConfig()
    config, floor = with_schedule(base, {"metadata": {"labels": {}}}, parsed, IN_PEAK)
    assert (config.scheduled_floor, config.scheduled_by) == (3, "schedule peak")
    assert floor is not None and floor.active == ("peak",)
    copy_of_hub = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "embedfleet-hub"}}}
    assert with_schedule(base, copy_of_hub, parsed, IN_PEAK) == (base, None)
    plain = EmbeddingDeploymentSpec.model_validate(spec())
    assert with_schedule(base, {}, plain, IN_PEAK) == (base, None)
    closed, _ = with_schedule(base, {}, parsed, AFTER_PEAK)
    assert (closed.scheduled_floor, closed.scheduled_by) == (0, "")


def test_admission_refuses_a_bad_entry_naming_it() -> None:
    bad = spec(schedule=[PEAK, {"name": "night", "start": "0 22 * *", "end": "0 6 * * *",
                                "timezone": "Europe/Berlln", "minReplicas": 2}])
    parsed, problems = check("emb", bad)
    assert parsed is None
    assert problems == [
        "spec.autoscaling.schedule[1] (night): timezone 'Europe/Berlln' is not an IANA time zone"
        " (e.g. Europe/Berlin)",
        "spec.autoscaling.schedule[1] (night): start '0 22 * *' has 4 fields, not 5"
        " (minute hour day-of-month month day-of-week)",
    ]
    good, problems = check("emb", spec(schedule=[PEAK]))
    assert problems == [] and good is not None and good.autoscaling.schedule[0].timezone == "Europe/Berlin"
    dumped = good.autoscaling.model_dump(by_alias=True, exclude_none=True)
    assert dumped["schedule"] == [PEAK]


def test_the_schema_refuses_too_many_entries_and_bad_names() -> None:
    many = [{**PEAK, "name": f"e{i}"} for i in range(17)]
    _, problems = check("emb", spec(schedule=many))
    assert any("spec.autoscaling.schedule" in p and "16" in p for p in problems), problems
    _, problems = check("emb", spec(schedule=[{**PEAK, "name": "Peak Hours"}]))
    assert any(p.startswith("spec.autoscaling.schedule[0].name") for p in problems), problems
