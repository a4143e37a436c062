"""``health.next_change``: when the hub must look at a silent spoke again. Its answer is exactly the moment
``observe`` (with no renewal seen) gives another reason, so the cluster reconcile that asks to be re-queued
then judges the spoke on time, and not a moment before it is due."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.hub.health import Health, next_change, observe

RENEW = "2026-11-26T00:00:00.000000Z"


@given(seen_ago=st.floats(0, 100), duration=st.floats(1, 60), grace=st.floats(0, 60))
def test_the_next_change_is_when_observe_changes_its_mind(seen_ago: float, duration: float, grace: float) -> None:
    now = 1000.0
    last = now - seen_ago
    health = observe(Health(True, True, RENEW, last, last, "LeaseValid"), RENEW, now, duration, grace)
    due = next_change(health, now, duration, grace)
    if not health.available:
        assert due is None and health.reason == "LeaseExpired"
        return
    assert due is not None and 0 <= due <= duration + grace
    # No renewal meanwhile: the same reason until the moment named, another one just after it.
    if due > 1e-3:
        assert observe(health, RENEW, now + due - 1e-3, duration, grace).reason == health.reason
    assert observe(health, RENEW, now + due + 1e-3, duration, grace).reason != health.reason


def test_nothing_to_wait_for_when_never_seen_or_expired() -> None:
    assert next_change(Health(), 10.0, 5, 5) is None
    assert next_change(Health(True, False, RENEW, 0.0, None, "LeaseExpired"), 100.0, 5, 5) is None


def test_valid_then_grace_then_expired() -> None:
    health = Health(True, True, RENEW, 100.0, 100.0, "LeaseValid")
    assert next_change(health, 102.0, 5, 5) == 3.0  # valid until 105
    assert next_change(health, 106.0, 5, 5) == 4.0  # in grace until 110
