"""Which engine a front sends a request to (`--engines N`, runtime split/spread.py): a pure decision."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.split.spread import Candidate, home_engine, pick_engine

candidates = st.lists(
    st.builds(Candidate, index=st.integers(0, 7), wait=st.floats(0, 30), tokens_per_s=st.floats(0, 1e6),
              unanswered=st.integers(0, 100_000), saturated=st.booleans()),
    max_size=8, unique_by=lambda c: c.index)


def start(c: Candidate, tokens: int) -> float:
    return c.wait + (c.unanswered + tokens) / max(c.tokens_per_s, 1.0)


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(0, 50_000))
def test_the_request_goes_where_it_would_start_soonest_among_those_not_saturated(cands, tokens):
    picked = pick_engine(cands, tokens, 8)
    if not cands:
        assert picked is None
        return
    chosen = next(c for c in cands if c.index == picked)
    open_ = [c for c in cands if not c.saturated] or cands
    assert chosen in open_
    assert start(chosen, tokens) <= min(start(c, tokens) for c in open_)


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(0, 50_000), st.text(min_size=1, max_size=20), st.integers(1, 8))
def test_a_tenant_with_a_quota_stays_on_its_home_engine_while_that_one_can_take_work(cands, tokens, tenant, n):
    cands = [c for c in cands if c.index < n]
    picked = pick_engine(cands, tokens, n, quota_tenant=tenant)
    home = home_engine(tenant, n)
    if any(c.index == home for c in cands):
        assert picked == home  # however loaded: its one bucket is there
    elif cands:
        assert picked in {c.index for c in cands}  # its home is restarting: another serves it meanwhile
    else:
        assert picked is None


def test_the_home_engine_is_the_same_in_every_process_and_spreads_tenants():
    """A hash of the name, not Python's (salted per process): every front agrees on it."""
    assert home_engine("team-search", 4) == home_engine("team-search", 4)
    homes = {home_engine(f"tenant-{i}", 4) for i in range(40)}
    assert homes == {0, 1, 2, 3}


def test_a_fronts_own_unanswered_work_spreads_a_burst_the_snapshot_has_not_seen():
    """Two idle engines in the last snapshot: the requests of a burst alternate between them instead of all
    going to the first, because the front counts what it has sent and not had answered."""
    unanswered = [0, 0]
    for _ in range(10):
        cands = [Candidate(i, 0.0, 1000.0, unanswered[i]) for i in range(2)]
        unanswered[pick_engine(cands, 100, 2)] += 100
    assert unanswered == [500, 500]
