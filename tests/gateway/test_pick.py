"""Which replica gets a request: worked examples, then the invariants hypothesis hunts for breaks in."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.pick import ROUTABLE, State, expected_wait, pick, pick_in_turn


@dataclass
class R:
    name: str
    state: State = State.READY
    reported_wait_s: float = 0.0
    in_flight: int = 0
    service_s: float = 0.01


def test_least_expected_wait_wins():
    slow, fast = R("slow", reported_wait_s=2.0), R("fast", reported_wait_s=0.1)
    assert pick([slow, fast], random.Random(0)) is fast


def test_own_requests_in_flight_count_as_wait():
    # 0.5 s reported, nothing of ours in flight, vs nothing reported but 10 of ours at 0.1 s each
    quiet, ours = R("quiet", reported_wait_s=0.5), R("ours", in_flight=10, service_s=0.1)
    assert pick([quiet, ours], random.Random(0)) is quiet


def test_equal_wait_goes_to_fewest_in_flight():
    a, b = R("a", reported_wait_s=0.2, in_flight=2, service_s=0.0), R("b", reported_wait_s=0.2, in_flight=1,
                                                                       service_s=0.0)
    assert pick([a, b], random.Random(0)) is b


def test_busy_only_when_nothing_ready_and_never_down_or_draining():
    busy, ready = R("busy", State.BUSY), R("ready", State.READY, reported_wait_s=30)
    assert pick([busy, ready], random.Random(0)) is ready
    assert pick([busy, R("down", State.DOWN), R("drain", State.DRAINING)], random.Random(0)) is busy
    assert pick([R("down", State.DOWN), R("drain", State.DRAINING)], random.Random(0)) is None
    assert pick([], random.Random(0)) is None


replicas = st.lists(
    st.builds(R, name=st.text(max_size=3), state=st.sampled_from(list(State)),
              reported_wait_s=st.floats(0, 100), in_flight=st.integers(0, 50), service_s=st.floats(0, 5)),
    max_size=8)


@given(replicas, st.integers())
def test_never_picks_a_replica_that_cannot_take_work(rs, seed):
    chosen = pick(rs, random.Random(seed))
    if any(r.state in ROUTABLE for r in rs):
        assert chosen is not None and chosen.state in ROUTABLE
    else:
        assert chosen is None


@given(replicas, st.integers())
def test_picks_a_least_wait_replica_of_the_best_state(rs, seed):
    chosen = pick(rs, random.Random(seed))
    if chosen is None:
        return
    tier = [r for r in rs if r.state is (State.READY if any(r.state is State.READY for r in rs) else State.BUSY)]
    assert chosen.state is tier[0].state
    assert round(expected_wait(chosen), 6) == min(round(expected_wait(r), 6) for r in tier)
    ties = [r for r in tier if round(expected_wait(r), 6) == round(expected_wait(chosen), 6)]
    assert chosen.in_flight == min(r.in_flight for r in ties)


@given(st.integers(2, 8), st.integers(1, 200), st.floats(0, 10), st.floats(0, 1), st.integers())
def test_identical_replicas_share_requests_evenly(n, requests, wait, service, seed):
    """Each pick adds one in flight to the chosen replica: counts never differ by more than one."""
    rs = [R(str(i), reported_wait_s=wait, service_s=service) for i in range(n)]
    rng = random.Random(seed)
    for _ in range(requests):
        pick(rs, rng).in_flight += 1
    counts = [r.in_flight for r in rs]
    assert max(counts) - min(counts) <= 1


def test_identical_idle_replicas_are_chosen_at_random_not_in_turn():
    rs = [R(str(i)) for i in range(4)]
    rng = random.Random(7)
    seen = Counter(pick(rs, rng).name for _ in range(400))
    assert set(seen) == {"0", "1", "2", "3"}
    assert min(seen.values()) > 50


def test_round_robin_goes_in_turn_over_the_best_state_blind_to_load():
    a, b, c = R("a", reported_wait_s=30), R("b"), R("c", State.DOWN)
    assert [pick_in_turn([a, b, c], turn).name for turn in range(4)] == ["a", "b", "a", "b"]
    assert pick_in_turn([R("busy", State.BUSY), c], 3).name == "busy"
    assert pick_in_turn([c], 0) is None
