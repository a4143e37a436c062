"""Held requests: bounded, released interactive first then oldest first, refused past the bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.hold import Held, HeldQueue


def held(arrival: int, bulk: bool = False) -> Held[str]:
    return Held(arrival, float(arrival), f"r{arrival}", bulk)


def test_release_is_in_arrival_order_and_empties_the_queue():
    q: HeldQueue[str] = HeldQueue(4)
    for a in (1, 2, 3):
        assert q.admit(held(a))
    assert [h.item for h in q.release()] == ["r1", "r2", "r3"]
    assert len(q) == 0 and q.oldest() is None


def test_refuses_past_the_bound():
    q: HeldQueue[str] = HeldQueue(2)
    assert q.admit(held(1)) and q.admit(held(2))
    assert q.full and not q.admit(held(3))
    assert [h.arrival for h in q] == [1, 2]


def test_a_request_sent_back_keeps_its_place():
    q: HeldQueue[str] = HeldQueue(3)
    q.admit(held(5))
    q.admit(held(7))
    q.admit(held(6))  # arrived before 7, held again after its replica failed
    assert [h.arrival for h in q.release()] == [5, 6, 7]


def test_removing_one_that_gave_up():
    q: HeldQueue[str] = HeldQueue(3)
    one, two = held(1), held(2)
    q.admit(one)
    q.admit(two)
    assert q.remove(one) and not q.remove(one)
    assert q.oldest() is two


def test_zero_bound_holds_nothing_and_negative_is_an_error():
    assert not HeldQueue(0).admit(held(1))
    with pytest.raises(ValueError):
        HeldQueue(-1)


ops = st.lists(st.one_of(st.tuples(st.just("admit")), st.tuples(st.just("remove"), st.integers(0, 40)),
                         st.tuples(st.just("release"), st.one_of(st.none(), st.integers(0, 5)))), max_size=60)


@given(st.integers(0, 10), ops)
def test_bounded_fifo_under_any_sequence(bound, script):
    """Against a plain model: never more than `bound` held, admitted iff there was room, releases oldest
    first, and everything admitted is released or removed exactly once."""
    q: HeldQueue[str] = HeldQueue(bound)
    model: list[Held[str]] = []
    admitted, out = [], []
    arrival = 0
    for op in script:
        if op[0] == "admit":
            arrival += 1
            h = held(arrival)
            ok = q.admit(h)
            assert ok == (len(model) < bound)
            if ok:
                model.append(h)
                admitted.append(h)
        elif op[0] == "remove":
            if model:
                h = model[op[1] % len(model)]
                assert q.remove(h)
                model.remove(h)
                out.append(h)
        else:
            n = op[1]
            got = q.release(n)
            expect = model[: len(model) if n is None else n]
            assert got == expect and [g.arrival for g in got] == sorted(g.arrival for g in got)
            model = model[len(expect):]
            out.extend(got)
        assert len(q) == len(model) <= bound
        assert list(q) == model
    out.extend(q.release())
    assert sorted(h.arrival for h in out) == [h.arrival for h in admitted]


def test_queries_are_released_before_bulk_work_held_earlier():
    q: HeldQueue[str] = HeldQueue(8)
    for a, bulk in ((1, True), (2, True), (3, False), (4, True), (5, False)):
        q.admit(held(a, bulk))
    assert q.oldest().arrival == 1  # how long the deployment has been cold: whatever the class
    assert [h.arrival for h in q.release()] == [3, 5, 1, 2, 4]


@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=40), st.integers(0, 12))
def test_release_order_is_class_then_arrival_under_any_sequence(script, bound):
    """Admit (bulk or not) or remove the longest held, in any order: what is released is every
    interactive request before any bulk one, each class in arrival order, each request once."""
    q: HeldQueue[str] = HeldQueue(bound)
    live: list[Held[str]] = []
    for arrival, (admit, bulk) in enumerate(script):
        if admit:
            h = held(arrival, bulk)
            if q.admit(h):
                live.append(h)
        elif live:
            oldest = q.oldest()
            assert oldest is min(live, key=lambda h: h.since)
            assert q.remove(oldest) and not q.remove(oldest)
            live.remove(oldest)
        assert len(q) == len(live) <= bound
    out = q.release()
    assert out == sorted(live, key=lambda h: (h.bulk, h.arrival)) and len(q) == 0
