"""Properties of the pure admission decision (core/admission.py), the drain rate it divides by
(core/drain_rate.py) and the batcher's running totals."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.core.admission import decide
from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.core.drain_rate import BATCHES, SEED_RUNS, DrainRate, estimate, timed_seed
from embedfleet.runtime.core.jobs import DeadlineUnmet, QueueFull
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


def test_queue_gauges_are_read_when_scraped():
    """The queue gauges are the batch manager's state at the moment of the scrape (set_function), not a
    copy refreshed on every submit and batch: nothing on the request path updates them."""

    async def scenario() -> None:
        metrics = RuntimeMetrics()
        with ThreadPoolExecutor(1) as pool:
            bm = BatchManager(lambda batch: batch, 16384, 2, 10**6, metrics.for_model("m"), pool)
            bm.seed_rate(1000, 1.0)

            def scraped(name: str) -> float | None:
                return metrics.registry.get_sample_value(name, {"model": "m"})

            assert (scraped("embedfleet_queue_tokens"), scraped("embedfleet_queue_requests")) == (0, 0)
            job = bm.submit([[1] * 100, [1] * 300], urgent=False)
            assert (scraped("embedfleet_queue_tokens"), scraped("embedfleet_queue_requests")) == (400, 1)
            assert scraped("embedfleet_expected_wait_seconds") == pytest.approx(bm.expected_wait())
            assert scraped("embedfleet_expected_wait_seconds") == pytest.approx(0.4)
            bm.cancel(job)
            assert (scraped("embedfleet_queue_tokens"), scraped("embedfleet_queue_requests")) == (0, 0)
            assert scraped("embedfleet_expected_wait_seconds") == 0

    asyncio.run(scenario())


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


def between(at: float | None, before: float, after: float, offset: float) -> bool:
    """`at` is `offset` seconds after the submit, whose own instant lies in [before, after] (clock reads
    bracketing it, so a preemption between them widens the bracket instead of failing the check)."""
    return at is not None and before + offset - 1e-6 <= at <= after + offset + 1e-6


def test_bulk_work_is_promoted_in_time_and_behind_the_queries_already_queued():
    """Starved bulk work becomes urgent early enough to finish within its bound (its own run time and
    one urgent bound before it), and joins the urgent queue at its back: a query admitted before the
    promotion was promised a wait that did not count the bulk work."""

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            # one input per batch, so the first batch is the planner's anchor alone
            bm = BatchManager(lambda batch: batch, 16384, 1, 10**6, RuntimeMetrics().for_model("m"), pool,
                              urgent_wait_s=5.0)
            bm.seed_rate(1000, 1.0)  # 1000 tokens/s
            t0 = time.monotonic()
            bulk = bm.submit([[1] * 500, [1] * 500], urgent=False, max_wait=30.0)
            now = time.monotonic()
            assert between(bulk.promote_at, t0, now, 27.0 - 1.0 - 5.0)  # margin 3 s, own 1 s, urgent 5 s
            query = bm.submit([[1] * 10], urgent=True, max_wait=5.0)
            bulk.promote_at = now  # its time has come
            first = bm._take_batch()
            assert bulk.urgent, "promoted"
            assert [item.job for item in first] == [query], "the query queued before the promotion goes first"
            bm._running_tokens = 0
            assert [item.job for item in bm._take_batch()] == [bulk]
            t0 = time.monotonic()
            late = bm.submit([[1] * 10], urgent=False, max_wait=2.0)  # a bound shorter than the urgent one
            assert between(late.promote_at, t0, time.monotonic(), 1.0), "at half its bound"
            t0 = time.monotonic()
            huge = bm.submit([[1] * 25_000], urgent=False, max_wait=30.0)  # 25 s alone
            assert between(huge.promote_at, t0, time.monotonic(), 15.0), "never before half"

    asyncio.run(scenario())


def test_bulk_work_is_judged_by_what_the_queries_leave_of_the_engine():
    """Queries go first, so a bulk request's wait is its work ahead over the rate the queries leave:
    with urgent work arriving at 600 of 1000 tokens/s, 800 tokens ahead are 2 s of waiting, not 0.8 s."""

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            bm = BatchManager(lambda batch: batch, 16384, 64, 10**6, RuntimeMetrics().for_model("m"), pool)
            bm.seed_rate(1000, 1.0)
            assert bm.drain_rate(urgent=False) == bm.drain_rate(urgent=True) == 1000
            bm.submit([[1] * 800], urgent=False)
            assert bm.expected_wait(urgent=False) == pytest.approx(0.8)
            bm.submit([[1] * 3000], urgent=True)  # 3000 urgent tokens over the 5 s window: 600 tokens/s
            assert bm.urgent_arrival_rate() == pytest.approx(600, rel=0.01)
            assert bm.drain_rate(urgent=False) == pytest.approx(400, rel=0.02)
            assert bm.drain_rate(urgent=True) == 1000, "queries are judged by the whole rate"
            bm.submit([[1] * 100_000], urgent=True)  # arrivals past the rate: bulk keeps its promoted share
            assert bm.drain_rate(urgent=False) == pytest.approx(100)
            with pytest.raises(QueueFull):  # 103,800 tokens ahead at 100 tokens/s is far past 30 s
                bm.submit([[1] * 10], urgent=False, max_wait=30.0)

    asyncio.run(scenario())


# -- the drain rate admission divides by (core/drain_rate.py) ---------------------------------------------
rates = st.floats(1.0, 1e6, allow_nan=False)
figures = st.tuples(st.integers(0, 1_000_000), st.floats(0.0, 100.0, allow_nan=False))
batch = st.tuples(st.integers(1, 100_000), st.floats(0.001, 10.0, allow_nan=False))


@given(rates, figures, figures, st.integers(0, 100_000), st.floats(0.0, 100.0, allow_nan=False))
def test_the_estimate_is_the_most_pessimistic_figure(long_run, window, last, running, elapsed):
    r = estimate(long_run, window, last, running, elapsed)
    assert 0 < r <= long_run
    for tokens, seconds in (window, last):
        if tokens > 0 and seconds > 0:
            assert r <= tokens / seconds * (1 + EPS)
    if running and elapsed * r > running * (1 + EPS):
        raise AssertionError("a batch running longer than the rate allows brings the rate down to its own")


@given(rates, figures, st.integers(1, 100_000), st.floats(0.001, 100.0, allow_nan=False))
def test_a_running_batch_within_the_rate_changes_nothing(long_run, window, running, elapsed):
    base = estimate(long_run, window)
    if elapsed * base <= running:
        assert estimate(long_run, window, running_tokens=running, running_s=elapsed) == base
    else:
        assert estimate(long_run, window, running_tokens=running, running_s=elapsed) == pytest.approx(running / elapsed)


@given(rates, st.lists(batch, max_size=20), batch, st.floats(0.0, 1.0))
def test_a_slower_batch_never_raises_the_rate(seed, history, new, share):
    """The same batch draining fewer tokens in the same time (the machine got slower) never makes the
    estimate faster."""
    def after(tokens: int) -> float:
        d = DrainRate()
        d.seed(int(seed), 1.0)
        t = 0.0
        for n, s in history:
            t += s
            d.observe(t, n, s)
        d.observe(t + new[1], tokens, new[1])
        return d.rate(t + new[1])

    assert after(max(1, int(new[0] * share))) <= after(new[0]) * (1 + 1e-9)


@given(rates, st.lists(batch, max_size=20), st.integers(1, 100_000), st.floats(0.01, 2.0))
def test_a_slowed_engine_is_seen_within_two_batches(seed, history, tokens, seconds):
    """However fast the engine was (the seed, the history), after two batches at the slow rate the
    estimate is no faster than that rate."""
    d = DrainRate()
    d.seed(int(seed), 0.01)
    t = 0.0
    for n, s in history:
        t += s
        d.observe(t, n, s)
    for _ in range(BATCHES):
        t += seconds
        d.observe(t, tokens, seconds)
    assert d.rate(t) <= tokens / seconds * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["observe", "read", "seed"]), st.floats(0.0, 4.0),
                          st.integers(0, 20_000), st.floats(0.0, 2.0)), max_size=40))
def test_a_read_is_the_estimate_of_the_figures_however_reads_and_batches_interleave(steps):
    """The rate kept between batches is the rate worked out afresh from the window at every read."""
    d, now = DrainRate(window_s=3.0), 0.0
    for op, gap, n, seconds in steps:
        now += gap
        if op == "observe":
            d.observe(now, n, seconds)
        elif op == "seed":
            d.seed(n, seconds)
        else:
            running, elapsed = n // 2, seconds
            got = d.rate(now, running, elapsed)
            window = [b for b in d._window if b.ended >= now - d.window_s]
            last = window[-BATCHES:]
            want = estimate(d.long_run, (sum(b.tokens for b in window), sum(b.seconds for b in window)),
                            (sum(b.tokens for b in last), sum(b.seconds for b in last)), running, elapsed)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (got, want)


def test_the_recent_figures_forget_old_batches_and_the_seed_is_long_run_only():
    d = DrainRate(window_s=3.0)
    d.seed(10_000, 1.0)
    assert d.rate(0.0) == 10_000, "a seed alone: the long-run rate"
    d.observe(1.0, 100, 1.0)  # slow
    assert d.rate(1.0) == pytest.approx(100)
    d.observe(10.0, 50_000, 1.0)  # much later, fast again: the slow batch has left the window
    assert d.rate(10.0) == pytest.approx(d.long_run)
    assert d.rate(100.0) == pytest.approx(d.long_run), "an idle engine keeps its long-run rate"
    assert DrainRate().rate(0.0) == 0, "unmeasured"


def test_a_request_admitted_before_the_engine_slowed_is_refused_not_answered_late():
    """Queued on a fast rate, then the engine is measured slow: at the next plan, a query that would
    now finish past its bound is refused (429, Retry-After) instead of run; the one at the head, whose own
    work still fits its bound at the new rate, runs."""

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            bm = BatchManager(lambda batch: batch, 16384, 1, 10**6, RuntimeMetrics().for_model("m"), pool)
            bm.seed_rate(10_000, 1.0)  # 10,000 tokens/s: 3,000 tokens ahead are 0.3 s
            first = bm.submit([[1] * 1000], urgent=True, max_wait=2.0)  # 1 s of its own at the slowed rate
            jobs = [bm.submit([[1] * 1000], urgent=True, max_wait=1.0) for _ in range(3)]
            bm._observe(time.perf_counter(), 1000, 1.0)  # a batch of 1,000 tokens took 1 s
            assert bm.drain_rate() == pytest.approx(1000, rel=0.01)
            batch = bm._take_batch()
            assert [item.job for item in batch] == [first], "nothing ahead of it: it runs"
            for job in jobs:
                assert job.future.done() and isinstance(job.future.exception(), QueueFull)
                assert job.future.exception().retry_after >= 1
            assert bm.queued_tokens == 0 and bm._queued_jobs == 0

    asyncio.run(scenario())


def test_only_a_request_admitted_past_its_bound_on_an_empty_queue_is_exempt_from_its_promise():
    """An empty queue admits a request whatever its bound; only one that alone is expected to take longer than
    its bound is `alone` (promised nothing it could keep). One that fits keeps a promise the lateness check
    holds it to, like any other."""

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            bm = BatchManager(lambda batch: batch, 16384, 64, 10**6, RuntimeMetrics().for_model("m"), pool)
            bm.seed_rate(1000, 1.0)  # 1000 tokens/s
            fits = bm.submit([[1] * 2000], urgent=False, max_wait=6.0)  # 2 s of work, nothing ahead
            assert not fits.alone and fits.promised is not None
            bm._drop(fits)
            assert bm.queued_tokens == 0
            over = bm.submit([[1] * 8000], urgent=False, max_wait=6.0)  # 8 s alone: admitted by the empty queue
            assert over.alone

    asyncio.run(scenario())


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 2000), min_size=SEED_RUNS, max_size=SEED_RUNS), st.integers(0, SEED_RUNS - 1))
def test_the_seed_is_the_fastest_timed_run_and_one_slow_run_does_not_set_it(durations, slow):
    """The start-up seed runs the batch SEED_RUNS times, each timed; one run held up (a busy machine's
    scheduler) does not become the engine's rate."""
    durations = list(durations)
    durations[slow] = 5000  # any one run held up (milliseconds: exact sums)
    now = [0]
    calls: list[int] = []

    def run(batch: list) -> None:
        now[0] += durations[len(calls)]
        calls.append(len(batch))

    tokens, seconds = timed_seed(run, [[1] * 32] * 8, clock=lambda: now[0])
    assert tokens == 256 and calls == [8] * SEED_RUNS
    assert seconds == min(durations) < 5000


def test_lone_queries_do_not_make_a_backfill_look_slow():
    """A run of lone queries (a dozen tokens each, mostly the engine call's fixed cost) stays out of the drain
    rate, so a bulk request that follows is judged by the rate measured on batches of real size. Counted, 30
    queries read as about 2,500 tokens/s on an engine that drains 20,000 a second, and 10,000 tokens ahead
    looked like 4 s instead of about 0.5 s (a backfill behind interactive traffic was refused for 38 s of
    wait it would never have had)."""
    overhead_s, per_token_s = 0.004, 1 / 20_000  # the engine: 4 ms a call, then 20,000 tokens a second
    overhead_tokens = round(overhead_s / per_token_s)  # what --batch-overhead-tokens measures: 80

    def engine(batch: list) -> list:
        time.sleep(overhead_s + sum(map(len, batch)) * per_token_s)
        return batch

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            bm = BatchManager(engine, 16384, 64, 10**6, RuntimeMetrics().for_model("m"), pool,
                              overhead_tokens=overhead_tokens)
            bm.seed_rate(2_000, overhead_s + 2_000 * per_token_s)  # the start-up batch (ModelService.load)
            bm.start()
            for _ in range(30):  # one client, one query at a time
                await bm.submit([[1] * 12], urgent=True).future
                for _ in range(3):  # the bookkeeping turn after the answer
                    await asyncio.sleep(0)
            for _ in range(4):  # then a backfill: four requests of 2,500 tokens queued at once
                bm.submit([[1] * 100] * 25, urgent=False)
            truth = 10_000 * per_token_s  # their tokens at the engine's rate, before any fixed cost
            assert truth * 0.7 <= bm.expected_wait(urgent=False) <= truth * 2
            await bm.stop()

    asyncio.run(scenario())


def test_a_bulk_batch_paused_for_queries_is_not_read_as_slow():
    """The batch in the engine lowers the rate when it overruns it (`estimate`), by its tokens over its own
    elapsed time: the time it spent paused while queries' batches ran is theirs, not its slowness. A bulk
    batch of 1,000 tokens at 1,000 tokens/s, 1.5 s in, of which 0.6 s paused, is on time."""
    with ThreadPoolExecutor(1) as pool:
        bm = BatchManager(lambda batch: batch, 16384, 32, 10**6, RuntimeMetrics().for_model("m"), pool)
        bm.seed_rate(1_000, 1.0)
        bm._running_tokens, bm._running_since = 1_000, time.perf_counter() - 1.5
        assert bm.drain_rate() == pytest.approx(1_000 / 1.5, rel=0.05), "1.5 s of its own: overrunning"
        bm._paused_s = 0.6
        assert bm.drain_rate() == 1_000.0, "0.9 s of its own: within the rate"
        bm._paused_s, bm._pause_started = 0.0, time.perf_counter() - 0.6
        assert bm.drain_rate() == 1_000.0, "a pause still under way is not its time either"


def test_a_batch_run_after_the_forward_is_not_counted_again_in_the_next_gap():
    """A query's batch posted too late for a pause of the bulk batch runs after its forward, before its
    answer. Its time goes into the drain rate as its own; the next batch's gap must start when the engine
    was free again, not when the bulk forward ended (that counted the query's batch twice)."""
    from embedfleet.runtime.core.jobs import Item, Job

    def engine(inputs):
        time.sleep(0.05)
        return [[0.0] for _ in inputs]

    class Loop:  # the engine thread hands its results to the loop: record them instead
        calls: list = []

        def call_soon_threadsafe(self, fn, *args):
            self.calls.append((fn.__name__, args))

    with ThreadPoolExecutor(1) as pool:
        bm = BatchManager(engine, 16384, 32, 10**6, RuntimeMetrics().for_model("m"), pool)
        bm.preemptible_in(6)
        loop = Loop()
        job = Job([[1] * 100], urgent=True, future=None, remaining=1)  # type: ignore[arg-type]
        bm._posted = ([Item(job, 0, 0)], [[1] * 100])
        bm._accepting = True
        bm._compute(loop, [Item(job, 0, 1)], [[1] * 100])
        (posted, posted_args), (finish, finish_args) = loop.calls
        assert (posted, finish) == ("_finish_posted", "_finish")
        assert finish_args[5] < posted_args[-1] <= finish_args[7], "the gap starts after the query's batch"
        bm._kick = lambda: None  # type: ignore[method-assign]  # (plans the next batch: nothing queued here)
        bm._queued_tokens = 100  # work waiting: the next batch's gap counts from the engine's free time
        batch, inputs, _rows, _error, started, ended, paused, free = finish_args
        bm._after(batch, inputs, started, ended, paused, True, free)
        assert bm._books.last_end == free
