"""The batch manager's scheduling (core/batcher.py): callbacks between the loop and one engine thread.

A stand-in engine function on a real engine thread, the real event loop: what these check is what a
request sees (its rows, in order; an error instead of a hang) and what the next request sees (the
server still serving, the drain rate measured).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from embedfleet.runtime.core import batcher
from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.metrics import RuntimeMetrics


def rows_of(batch: list) -> np.ndarray:
    """One row per input: [its length, its first token], so a row says which input it came from."""
    return np.array([[len(ids), ids[0]] for ids in batch], dtype=np.float32)


class Engine:
    """Records each batch and the thread it ran on; `fail` makes the next batch raise, `short` makes
    it return one row too few."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.threads: set[str] = set()
        self.fail = False
        self.short = False

    def __call__(self, batch: list) -> np.ndarray:
        self.batches.append(batch)
        self.threads.add(threading.current_thread().name)
        if self.fail:
            self.fail = False
            raise RuntimeError("engine broke on this batch")
        rows = rows_of(batch)
        if self.short:
            self.short = False
            return rows[:-1]
        return rows


PATIENCE_S = 10  # how long a test waits for an answer: only so that a broken scheduler cannot hang it


def with_manager(engine: Engine, scenario, max_requests: int = 32, metrics: RuntimeMetrics | None = None,
                 preemptible: bool = False) -> None:
    """Run `scenario(bm, pool)` on a started manager over one engine thread, past start()'s own (empty)
    planning turn, and stop the manager afterwards. `preemptible`: the manager treats the engine as one
    that pauses between layers (it hands the next bulk batch over early); this engine never pauses."""

    async def main() -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="engine") as pool:
            bm = BatchManager(engine, 16384, max_requests, 10**6, (metrics or RuntimeMetrics()).for_model("m"), pool)
            if preemptible:
                bm.preemptible_in(1)
            bm.start()
            await asyncio.sleep(0)
            try:
                await scenario(bm, pool)
            finally:
                await bm.stop()

    asyncio.run(main())


def answer(job):
    return asyncio.wait_for(job.future, PATIENCE_S)


def test_requests_get_their_own_rows_in_order_from_the_engine_thread():
    engine = Engine()

    async def scenario(bm: BatchManager, _pool) -> None:
        jobs = [bm.submit([[k, 1] * (k + 1), [k + 10]], urgent=True) for k in range(4)]
        results = [await answer(job) for job in jobs]
        for k, rows in enumerate(results):
            assert rows.tolist() == [[2.0 * (k + 1), k], [1.0, k + 10]], f"request {k} got another's rows"
        assert all(len(b) <= 3 for b in engine.batches) and sum(map(len, engine.batches)) == 8
        assert engine.threads == {"engine_0"}, "only the engine thread touches the model"

    with_manager(engine, scenario, max_requests=3)


def test_requests_queued_in_one_loop_turn_share_a_batch():
    """Planning waits for the end of the loop turn: a burst tokenized together runs together."""
    engine = Engine()

    async def scenario(bm: BatchManager, _pool) -> None:
        jobs = [bm.submit([[k + 1] * 5], urgent=True) for k in range(6)]
        for job in jobs:
            await answer(job)
        assert [len(b) for b in engine.batches] == [6]

    with_manager(engine, scenario)


@pytest.mark.parametrize("fault", ["raise", "short"])
def test_a_failed_batch_fails_its_requests_and_the_next_one_is_served(fault):
    """An engine error, or an engine that returns the wrong number of rows, reaches the batch's
    requests as an exception (the route turns it into a 5xx or 503), never a request left waiting."""
    engine = Engine()

    async def scenario(bm: BatchManager, _pool) -> None:
        setattr(engine, "fail" if fault == "raise" else "short", True)
        broken = bm.submit([[1] * 4, [2] * 4], urgent=True)
        with pytest.raises(RuntimeError, match=r"engine broke|returned 1 rows for a batch of 2"):
            await answer(broken)
        after = bm.submit([[7] * 3], urgent=True)
        assert (await answer(after)).tolist() == [[3.0, 7.0]]
        assert bm.queued_tokens == 0 and bm.ahead_of(urgent=True) == 0

    metrics = RuntimeMetrics()
    with_manager(engine, scenario, metrics=metrics)
    failures = [s.value for family in metrics.registry.collect() for s in family.samples
                if s.name == "embedfleet_engine_failures_total"]
    assert failures == [1.0], "one failed batch, counted once; the one after it is not"


def test_bookkeeping_follows_each_batch():
    """The drain rate, the tokens counter and the queue-wait histogram are kept, though they are
    updated off the request's path (while the engine computes, or after the answers)."""
    engine = Engine()
    metrics = RuntimeMetrics()

    async def scenario(bm: BatchManager, _pool) -> None:
        assert bm.tokens_per_s == 0
        await answer(bm.submit([[1] * 50, [2] * 30], urgent=True, tenant="search"))
        for _ in range(3):  # the bookkeeping turn after the answer
            await asyncio.sleep(0)
        assert bm.tokens_per_s > 0, "the batch was timed into the drain rate"

    with_manager(engine, scenario, metrics=metrics)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metrics.registry.collect() for s in family.samples}
    waits = [v for (name, labels), v in samples.items()
             if name.endswith("queue_wait_seconds_count") and ("tenant", "search") in labels]
    assert waits == [1.0], samples.keys()
    assert samples[("embedfleet_tokens_total", (("model", "m"),))] == 80.0


def test_stop_starts_no_further_batch():
    engine = Engine()

    async def scenario(bm: BatchManager, pool: ThreadPoolExecutor) -> None:
        await bm.stop()
        job = bm.submit([[1] * 3], urgent=True)
        for _ in range(3):  # the turns a planning callback would have run in
            await asyncio.sleep(0)
        await asyncio.wrap_future(pool.submit(lambda: None))  # and anything it gave the engine thread ran
        assert not job.future.done() and engine.batches == []

    with_manager(engine, scenario)


class Clock:
    """The batch manager's clock (its `time` module) in the tests below: it moves only when the engine
    runs a batch, by exactly one second, so engine and queue times are exact figures, not timings."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


class ClockedEngine(Engine):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def __call__(self, batch: list) -> np.ndarray:
        self.clock.now += 1.0
        return super().__call__(batch)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(batcher, "time", fake)
    return fake


def engine_busy(metrics: RuntimeMetrics) -> float:
    return metrics.registry.get_sample_value("embedfleet_engine_busy_seconds_total", {"model": "m"})


def test_jobs_know_their_queue_wait_and_engine_time(clock):
    """What the server-timing and x-*-time headers report (timing.py): a job's inference time is the
    engine time of every batch its inputs ran in, and its queue time covers the batches run before it."""
    engine = ClockedEngine(clock)
    metrics = RuntimeMetrics()

    async def scenario(bm: BatchManager, _pool) -> None:
        first = bm.submit([[1], [2], [3]], urgent=True)  # one input per batch: three batches
        second = bm.submit([[4]], urgent=True)  # queued behind all three
        await answer(first)
        await answer(second)
        for _ in range(3):
            await asyncio.sleep(0)  # the bookkeeping turn that counts engine_busy
        assert len(engine.batches) == 4
        assert (first.queue_s, first.inference_s) == (0.0, 3.0), "each of its three batches counts"
        assert (second.queue_s, second.inference_s) == (3.0, 1.0), "it waited for the first job's three batches"
        assert engine_busy(metrics) == 4.0, "the engine time, each batch once"

    with_manager(engine, scenario, max_requests=1, metrics=metrics)


def test_inputs_sharing_a_batch_count_its_engine_time_once(clock):
    engine = ClockedEngine(clock)
    metrics = RuntimeMetrics()

    async def scenario(bm: BatchManager, _pool) -> None:
        job = bm.submit([[1], [2], [3]], urgent=True)
        await answer(job)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(engine.batches) == 1
        assert (job.queue_s, job.inference_s, engine_busy(metrics)) == (0.0, 1.0, 1.0)

    with_manager(engine, scenario, metrics=metrics)


def test_the_engine_gets_its_next_batch_before_the_answered_requests_resume():
    """A request's handler resumes after its batch and encodes its response, a millisecond or more for a
    bulk request; the engine must not sit idle meanwhile. When the first request's awaiter runs, the
    second request's batch is already on the engine (the manager is busy with it)."""
    engine = Engine()

    async def scenario(bm: BatchManager, _pool) -> None:
        first = bm.submit([[1]], urgent=False)
        second = bm.submit([[2]], urgent=False)  # max_requests=1: the next batch
        seen: list[tuple[bool, int]] = []
        first.future.add_done_callback(lambda _f: seen.append((bm._busy, bm._queued_tokens)))
        await answer(first)
        assert seen == [(True, 0)], "the second batch left the queue for the engine before the first answer"
        assert (await answer(second)).tolist() == [[1.0, 2.0]]

    with_manager(engine, scenario, max_requests=1)


def test_a_failed_bulk_batch_does_not_take_the_one_handed_over_behind_it():
    """The running bulk batch fails while the next one waits on the engine thread: the first request gets
    the error, the second its rows, and the server serves the next request."""
    engine = Engine()
    engine.fail = True

    async def scenario(bm: BatchManager, _pool) -> None:
        first = bm.submit([[1]], urgent=False)
        second = bm.submit([[2]], urgent=False)  # max_requests=1: handed over behind the first
        with pytest.raises(RuntimeError, match="engine broke"):
            await answer(first)
        assert (await answer(second)).tolist() == [[1.0, 2.0]]
        assert (await answer(bm.submit([[3]], urgent=False))).tolist() == [[1.0, 3.0]]
        assert len(engine.batches) == 3

    with_manager(engine, scenario, max_requests=1, preemptible=True)
