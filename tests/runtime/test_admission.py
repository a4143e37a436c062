"""Properties of the pure admission decision (core/admission.py) and the batcher's running totals."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.core.admission import decide
from embedfleet.runtime.core.batcher import BatchManager, DeadlineUnmet, QueueFull
from embedfleet.runtime.metrics import RuntimeMetrics

tokens = st.integers(0, 5_000_000)
own = st.integers(1, 100_000)
rate = st.floats(1.0, 1e6, allow_nan=False)
bound = st.floats(0.01, 120.0, allow_nan=False)
deadline = st.none() | st.floats(0.0, 120.0, allow_nan=False)
EPS = 1e-9


@given(tokens, tokens, own, rate, bound, deadline)
def test_monotone_in_the_queue(a, b, mine, r, limit, dl):
    """More work ahead never turns a refusal into an admission."""
    less, more = sorted((a, b))
    if decide(more, mine, r, limit, dl).admit:
        assert decide(less, mine, r, limit, dl).admit


@given(tokens, own, rate, bound, deadline)
def test_never_admits_beyond_the_bound(ahead, mine, r, limit, dl):
    d = decide(ahead, mine, r, limit, dl)
    assert d.expected_s == (ahead + mine) / r
    if d.admit:
        if dl is not None:
            assert d.expected_s <= dl
        if ahead:
            assert d.expected_s <= limit, "only an empty queue admits past the bound"
    else:
        assert d.reason in ("expected_wait", "deadline") and d.retry_after >= 1


@given(st.integers(1, 5_000_000), own, rate, bound)
def test_retry_after_is_the_least_wait_that_would_admit(ahead, mine, r, limit):
    """After `retry_after` seconds of draining at the measured rate (nothing new arriving) the same
    request is admitted; one second less and it would still be refused (when that is still >= 1)."""
    d = decide(ahead, mine, r, limit)
    if d.admit:
        return
    assert d.retry_after >= 1 and isinstance(d.retry_after, int)
    after = max(0.0, ahead - r * d.retry_after)
    assert after < EPS * max(1, ahead) or (after + mine) / r <= limit + EPS
    if d.retry_after > 1:
        sooner = ahead - r * (d.retry_after - 1)
        assert sooner > 0 and (sooner + mine) / r > limit - EPS


@given(tokens, own, bound, deadline)
def test_unmeasured_rate_admits(ahead, mine, limit, dl):
    assert decide(ahead, mine, 0.0, limit, dl).admit


def test_a_deadline_refuses_even_on_an_empty_queue():
    d = decide(0, 10_000, 1_000.0, 5.0, deadline_s=2.0)
    assert not d.admit and d.reason == "deadline" and d.expected_s == 10.0
    assert decide(0, 10_000, 1_000.0, 5.0).admit, "an empty queue always admits by the bound"


def test_running_totals_follow_submit_take_and_drop():
    """The figures admission reads on every submit are kept, never recounted from the queue."""

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            bm = BatchManager(lambda batch: batch, 16384, 2, 10**6, RuntimeMetrics().for_model("m"), pool)
            bm.seed_rate(1000, 1.0)
            urgent = bm.submit([[1] * 10], urgent=True)
            bulk = bm.submit([[1] * 100, [1] * 200, [1] * 300], urgent=False)
            assert (bm.queued_tokens, bm.ahead_of(urgent=True), bm.ahead_of(urgent=False)) == (610, 10, 610)
            assert bm._queued_jobs == 2
            batch = bm._take_batch()  # the urgent one alone (urgent batches take urgent work only)
            assert [item.job for item in batch] == [urgent]
            assert (bm.queued_tokens, bm.ahead_of(urgent=True), bm._queued_jobs) == (600, 10, 1)
            bm._running_tokens = 0
            bm.cancel(bulk)
            assert (bm.queued_tokens, bm._queued_jobs) == (0, 0)
            assert bm._take_batch() == [] and bm._queue == [], "the dropped job's items are skipped, then gone"
            admitted = bm.submit([[1] * 10], urgent=True, max_wait=0.001)  # empty queue: admitted
            with pytest.raises(QueueFull) as refused:
                bm.submit([[1] * 10], urgent=True, max_wait=0.001)  # 20 ms of work ahead of a 1 ms bound
            assert refused.value.retry_after >= 1 and refused.value.reason == "expected_wait"
            with pytest.raises(DeadlineUnmet):
                bm.submit([[1] * 10], urgent=True, deadline=time.monotonic() + 0.005)
            assert admitted.queued_tokens == 10 and bm.queued_tokens == 10

    asyncio.run(scenario())
