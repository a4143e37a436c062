"""Which engine a front sends a request to (`--engines N`, runtime split/spread.py): a pure decision."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.split.spread import Candidate, pick_engine

candidates = st.lists(
    st.builds(Candidate, index=st.integers(0, 7), wait=st.floats(0, 30), tokens_per_s=st.floats(0, 1e6),
              unanswered=st.integers(0, 100_000), saturated=st.booleans()),
    max_size=8, unique_by=lambda c: c.index)


def start(c: Candidate, tokens: int) -> float:
    return c.wait + (c.unanswered + tokens) / max(c.tokens_per_s, 1.0)


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(0, 50_000))
def test_the_request_goes_where_it_would_start_soonest_among_those_not_saturated(cands, tokens):
    picked = pick_engine(cands, tokens)
    if not cands:
        assert picked is None
        return
    chosen = next(c for c in cands if c.index == picked)
    open_ = [c for c in cands if not c.saturated] or cands
    assert chosen in open_
    assert start(chosen, tokens) <= min(start(c, tokens) for c in open_)


@settings(max_examples=300, deadline=None)
@given(candidates, st.integers(0, 50_000))
def test_a_tenant_with_a_quota_goes_to_the_first_engine_up_however_loaded(cands, tokens):
    """One engine keeps its bucket (and engine 0 also runs the async jobs that charge it): spread, it would
    get a bucket per engine."""
    picked = pick_engine(cands, tokens, quota=True)
    assert picked == (min(c.index for c in cands) if cands else None)


def test_a_fronts_own_unanswered_work_spreads_a_burst_the_snapshot_has_not_seen():
    """Two idle engines in the last snapshot: the requests of a burst alternate between them instead of all
    going to the first, because the front counts what it has sent and not had answered."""
    unanswered = [0, 0]
    for _ in range(10):
        cands = [Candidate(i, 0.0, 1000.0, unanswered[i]) for i in range(2)]
        unanswered[pick_engine(cands, 100)] += 100
    assert unanswered == [500, 500]


class _Link:
    def __init__(self, up: bool = True) -> None:
        self.up = up


def _state(urgent: float, bulk: float, saturated: bool, queued: int, rate: float, max_tokens: int = 16384) -> dict:
    return {"urgent_wait": urgent, "bulk_wait": bulk, "saturated": saturated, "queued_tokens": queued,
            "tokens_per_s": rate, "max_batch_tokens": max_tokens, "max_batch_requests": 32, "vector_space": None,
            "fingerprint": None, "effective_dtype": "float32", "probe": "pending"}


def test_a_fronts_view_of_several_engines_is_the_pods_not_one_engines():
    """The gate refuses before reading a body on this view: one engine full of backfill (so its urgent wait
    is the least) must not make the pod look full while another engine has room."""
    from embedfleet.runtime.settings import RuntimeSettings
    from embedfleet.runtime.split.front_side import FrontService

    svc = FrontService.__new__(FrontService)
    svc.settings = RuntimeSettings()
    svc.attach([_Link(), _Link(), _Link(up=False)])
    svc.update(_state(0.01, 9.0, True, 50_000, 1000.0), 0)
    svc.update(_state(0.2, 0.3, False, 300, 1500.0, max_tokens=8192), 1)
    svc.update(_state(0.0, 0.0, False, 0, 9999.0), 2)  # its link is down: not counted
    load = svc.batcher
    assert (load.urgent_wait, load.bulk_wait, load.saturated) == (0.01, 0.3, False)
    assert (load.queued_tokens, load.tokens_per_s) == (50_300, 2500.0)
    assert svc.settings.max_batch_tokens == 8192  # the smallest engine's limits
    svc.update(_state(0.5, 0.5, True, 9000, 1500.0), 1)
    assert svc.batcher.saturated  # full only when every live engine is
    svc.update(None, 0)
    svc.update(None, 1)
    assert svc.batcher is None and svc.state is None
