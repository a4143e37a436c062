"""The hub's per-spoke circuit breaker: opens only after THRESHOLD consecutive failures, waits a bounded,
growing time, and closes on the first success."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.hub.breaker import BASE_SECONDS, CAP_SECONDS, THRESHOLD, Breaker


@given(st.lists(st.booleans(), max_size=40), st.floats(0, 1e6))
def test_open_only_after_consecutive_failures_and_never_longer_than_the_cap(outcomes: list[bool],
                                                                            now: float) -> None:
    breaker, streak = Breaker(), 0
    for ok in outcomes:
        breaker = breaker.succeeded() if ok else breaker.failed(now, "refused")
        streak = 0 if ok else streak + 1
        assert breaker.failures == streak
        assert breaker.is_open(now) == (streak >= THRESHOLD)
        assert breaker.open_until <= now + CAP_SECONDS
        assert breaker.allows(now + CAP_SECONDS)


def test_back_off_doubles_from_the_base() -> None:
    breaker = Breaker()
    waits = []
    for _ in range(THRESHOLD + 3):
        breaker = breaker.failed(100.0, "timed out")
        waits.append(breaker.open_until - 100.0 if breaker.open_until else 0.0)
    assert waits[THRESHOLD - 1:] == [BASE_SECONDS, 2 * BASE_SECONDS, 4 * BASE_SECONDS, 8 * BASE_SECONDS]
    assert breaker.last_error == "timed out"
    assert breaker.succeeded() == Breaker()
