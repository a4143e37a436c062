"""The learned cold start, and the Retry-After it gives refused clients."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.coldstart import DEFAULT_COLD_START_S, ColdStart


def test_default_before_any_observation():
    cold = ColdStart()
    assert cold.expected_s() == DEFAULT_COLD_START_S == 30.0
    assert cold.retry_after(0) == 30 and cold.retry_after(10) == 20
    assert ColdStart(default_s=12).retry_after(0) == 12


def test_first_observation_replaces_the_default_then_a_weighted_mean():
    cold = ColdStart(alpha=0.5)
    cold.observe(8)
    assert cold.expected_s() == 8
    cold.observe(4)
    assert cold.expected_s() == 6


def test_a_hold_that_gave_up_raises_the_estimate_but_never_lowers_it():
    cold = ColdStart()
    cold.observe(10)
    cold.observe_at_least(5)
    assert cold.expected_s() == 10
    cold.observe_at_least(60)
    assert cold.expected_s() == 60


def test_retry_after_is_at_least_one_second():
    cold = ColdStart()
    cold.observe(2)
    assert cold.retry_after(100) == 1


durations = st.floats(0, 3600, allow_nan=False)


@given(st.lists(durations, max_size=10), st.lists(durations, max_size=10), durations, durations)
def test_retry_after_is_monotone_in_the_learned_time(history, more, waited, extra):
    """Two estimates learned from the same history, one then seeing longer cold starts: the longer
    estimate never asks clients to come back sooner."""
    short, long = ColdStart(), ColdStart()
    for d in history:
        short.observe(d)
        long.observe(d)
    for d in more:
        long.observe_at_least(d)
    long.observe_at_least(long.expected_s() + extra)
    assert long.expected_s() >= short.expected_s()
    assert long.retry_after(waited) >= short.retry_after(waited) >= 1


@given(st.floats(0, 3600), st.floats(0, 3600), durations)
def test_retry_after_monotone_in_expected_time(a, b, waited):
    lo, hi = sorted((a, b))
    assert ColdStart(default_s=lo).retry_after(waited) <= ColdStart(default_s=hi).retry_after(waited)


@given(st.lists(durations, min_size=1, max_size=20))
def test_estimate_stays_within_what_was_seen(observed):
    cold = ColdStart()
    for d in observed:
        cold.observe(d)
    assert min(observed) - 1e-9 <= cold.expected_s() <= max(observed) + 1e-9
