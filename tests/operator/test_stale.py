"""Counting pods that did not answer (stale.py): worked examples, then the invariants hypothesis checks.

The real-socket half (scraping servers that refuse, hang, drip or flood, and the autoscaler rising with
one replica unreachable) is in test_signals.py, next to the metric servers it starts.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.autoscale import AutoscalerConfig
from embedfleet.operator.signals import PodReading
from embedfleet.operator.stale import FleetLoad, LastSeen, count_pods, due_warnings

TARGET = 22.4
HOLD = 120.0


def ok(pod: str, in_flight: float, depth: float | None = None) -> PodReading:
    return PodReading(pod, in_flight, depth)


def failed(pod: str) -> PodReading:
    return PodReading(pod, None, error="ConnectError: refused")


# ---------------------------------------------------------------- worked examples


def test_a_failed_pod_counts_at_least_its_last_known_load() -> None:
    memory = {"c": LastSeen(40.0, 90.0)}
    fleet = count_pods([ok("a", 30), ok("b", 35), failed("c")], memory, 100.0, TARGET, HOLD)
    assert fleet.in_flight == 30 + 35 + 40
    (c,) = fleet.estimated
    assert (c.pod, c.counted, c.basis, c.error) == ("c", 40.0, "last-known", "ConnectError: refused")
    # Its memory is the last success, unchanged: the hold clock does not restart on a failure.
    assert fleet.memory["c"] == LastSeen(40.0, 90.0)
    assert fleet.memory["a"] == LastSeen(30.0, 100.0)


def test_a_failed_idle_pod_counts_as_the_target_not_zero() -> None:
    fleet = count_pods([ok("a", 0), failed("b")], {"b": LastSeen(0.0, 99.0)}, 100.0, TARGET, HOLD)
    assert fleet.in_flight == TARGET
    assert fleet.estimated[0].basis == "last-known" and fleet.estimated[0].counted == TARGET


def test_after_the_hold_a_failed_pod_counts_as_the_target() -> None:
    memory = {"b": LastSeen(500.0, 0.0)}
    inside = count_pods([ok("a", 10), failed("b")], memory, HOLD - 1, TARGET, HOLD)
    after = count_pods([ok("a", 10), failed("b")], memory, HOLD, TARGET, HOLD)
    assert inside.in_flight == 510.0
    assert after.in_flight == 10 + TARGET and after.estimated[0].basis == "target"
    assert after.memory["b"] == LastSeen(500.0, 0.0)  # still listed: remembered, just no longer trusted


def test_a_pod_that_never_answered_counts_as_the_target() -> None:
    fleet = count_pods([ok("a", 10), failed("new")], {}, 5.0, TARGET, HOLD)
    assert fleet.in_flight == 10 + TARGET
    assert fleet.estimated[0].basis == "target" and "never answered" in fleet.estimated[0].describe(5.0)
    assert "new" not in fleet.memory


def test_no_pod_answering_leaves_the_total_unknown() -> None:
    """No fresh evidence at all: the daemon keeps the size rather than scale on memory alone."""
    fleet = count_pods([failed("a"), failed("b")], {"a": LastSeen(50.0, 99.0)}, 100.0, TARGET, HOLD)
    assert fleet.in_flight is None
    assert fleet.memory == {"a": LastSeen(50.0, 99.0)}  # kept for when some pods answer again


def test_no_pods_listed_means_nothing_in_flight_and_nothing_remembered() -> None:
    fleet = count_pods([], {"gone": LastSeen(50.0, 99.0)}, 100.0, TARGET, HOLD)
    assert fleet.in_flight == 0.0 and fleet.memory == {}


def test_async_backlog_comes_from_the_pods_that_answered() -> None:
    fleet = count_pods([ok("a", 1, 300.0), ok("b", 1, 280.0), failed("c")], {}, 0.0, TARGET, HOLD)
    assert fleet.async_depth == 300.0
    assert count_pods([ok("a", 1)], {}, 0.0, TARGET, HOLD).async_depth is None


def test_the_hold_is_two_stable_windows() -> None:
    assert AutoscalerConfig(stable_window_s=60).last_known_hold_s == 120.0
    assert AutoscalerConfig(stable_window_s=30, panic_window_s=3).last_known_hold_s == 60.0


def test_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="target"):
        count_pods([failed("a")], {}, 0.0, 0.0, HOLD)


# ---------------------------------------------------------------- warnings: once per pod per interval


def _fleet(*readings: PodReading) -> FleetLoad:
    return count_pods(list(readings), {}, 0.0, TARGET, HOLD)


def test_an_unreachable_pod_is_warned_about_once_per_interval() -> None:
    fleet = _fleet(ok("a", 1), failed("b"), failed("c"))
    due, warned = due_warnings(fleet, {}, 0.0, 300.0)
    assert [p.pod for p in due] == ["b", "c"] and warned == {"b": 0.0, "c": 0.0}
    for now in (5.0, 100.0, 299.0):  # every tick in between: silence
        due, warned = due_warnings(fleet, warned, now, 300.0)
        assert due == ()
    due, warned = due_warnings(fleet, warned, 300.0, 300.0)
    assert [p.pod for p in due] == ["b", "c"]


def test_a_deleted_pod_is_forgotten_and_a_newcomer_is_news() -> None:
    _, warned = due_warnings(_fleet(ok("a", 1), failed("b")), {}, 0.0, 300.0)
    due, warned = due_warnings(_fleet(ok("a", 1), failed("d")), warned, 10.0, 300.0)
    assert [p.pod for p in due] == ["d"] and warned == {"d": 10.0}
    due, _ = due_warnings(_fleet(ok("a", 1), ok("d", 2)), warned, 20.0, 300.0)
    assert due == ()


# ---------------------------------------------------------------- properties

names = st.lists(st.sampled_from([f"pod-{i}" for i in range(8)]), min_size=1, max_size=8, unique=True)
loads = st.floats(min_value=0, max_value=10_000, allow_nan=False)


@st.composite
def ticks(draw: st.DrawFn) -> tuple[list[PodReading], dict[str, LastSeen], float, float, float]:
    """Listed pods (some answering), memory of some of them and of pods since deleted, now, target, hold."""
    listed = draw(names)
    now = draw(st.floats(min_value=0, max_value=10_000))
    readings = [ok(p, draw(loads)) if draw(st.booleans()) else failed(p) for p in listed]
    remembered = draw(st.lists(st.sampled_from([*listed, "deleted-1", "deleted-2"]), unique=True))
    memory = {p: LastSeen(draw(loads), now - draw(st.floats(min_value=0, max_value=1_000))) for p in remembered}
    target = draw(st.floats(min_value=0.1, max_value=500))
    hold = draw(st.floats(min_value=1, max_value=600))
    return readings, memory, now, target, hold


@given(ticks())
def test_failed_pods_only_ever_add_to_the_answered_total(tick: tuple) -> None:
    readings, memory, now, target, hold = tick
    fleet = count_pods(readings, memory, now, target, hold)
    answered = sum(r.in_flight for r in readings if r.in_flight is not None)
    failures = sum(1 for r in readings if r.in_flight is None)
    if failures == len(readings):
        assert fleet.in_flight is None
        return
    assert fleet.in_flight is not None
    assert fleet.in_flight >= answered
    assert fleet.in_flight >= answered + failures * target - 1e-6 * (1 + fleet.in_flight)


@given(ticks())
def test_a_listed_pod_that_failed_never_counts_as_zero(tick: tuple) -> None:
    readings, memory, now, target, hold = tick
    fleet = count_pods(readings, memory, now, target, hold)
    for pod in fleet.estimated:
        assert pod.counted >= target > 0
        last = memory.get(pod.pod)
        if last is not None and now - last.at < hold:
            assert pod.counted >= last.in_flight


@given(ticks())
def test_memory_covers_exactly_the_listed_pods_with_a_success(tick: tuple) -> None:
    readings, memory, now, target, hold = tick
    fleet = count_pods(readings, memory, now, target, hold)
    listed = {r.pod for r in readings}
    assert set(fleet.memory) <= listed  # deleted pods are dropped
    assert not {"deleted-1", "deleted-2"} & set(fleet.memory)
    for r in readings:
        if r.in_flight is not None:
            assert fleet.memory[r.pod] == LastSeen(r.in_flight, now)
        elif r.pod in memory:
            assert fleet.memory[r.pod] == memory[r.pod]
        else:
            assert r.pod not in fleet.memory


@given(st.lists(loads, min_size=2, max_size=8), st.data())
def test_a_pod_failing_right_after_answering_never_lowers_the_total(values: list[float], data: st.DataObject
                                                                    ) -> None:
    """Tick 1: everyone answers. Tick 2, same loads, one pod silent: the total cannot drop."""
    pods = [f"pod-{i}" for i in range(len(values))]
    first = count_pods([ok(p, v) for p, v in zip(pods, values, strict=True)], {}, 0.0, TARGET, HOLD)
    silent = data.draw(st.sampled_from(pods))
    readings = [failed(p) if p == silent else ok(p, v) for p, v in zip(pods, values, strict=True)]
    second = count_pods(readings, first.memory, 5.0, TARGET, HOLD)
    assert first.in_flight is not None and second.in_flight is not None
    assert second.in_flight >= first.in_flight
