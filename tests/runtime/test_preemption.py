"""Preemption: a query arriving while a bulk batch runs is run at the bulk batch's next layer boundary.

Three levels: the torch engine's pause between layers (a forward pass run inside the pause leaves both
results exact), the batch manager's hand-over with a stand-in engine whose "layers" the test steps
(no clock: the bulk batch is held at a boundary until the query is posted), and a real server, where a
query sent while a long bulk batch runs is answered before it, by a pause (the counter says so), and
the bulk answer is the same as without the pause.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.engines.torch_engine import TorchEngine, repeated_layers
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir

PATIENCE_S = 10  # only so that a broken hand-over cannot hang a test; nothing here checks speed


def test_engine_pauses_between_layers_and_a_forward_pass_inside_changes_nothing():
    engine = TorchEngine(load_spec(default_model_dir()), dtype="float32", num_threads=1)
    assert engine.preemptible
    layers = len(repeated_layers(engine.model))
    bulk = [[101] + [2000 + i for i in range(60)] + [102], [101, 7592, 102]]
    query = [[101, 2129, 2079, 1045, 102]]
    plain_bulk, plain_query = engine.embed(bulk), engine.embed(query)

    pauses: list[int] = []
    inside: list[np.ndarray] = []

    def pause() -> None:
        pauses.append(1)
        if len(pauses) == 2 and not inside:  # once, mid-way: the query's whole forward pass
            inside.append(engine.embed(query))

    engine.between_layers(pause)
    paused_bulk = engine.embed(bulk)
    # every layer but the first of the bulk pass, and of the query's pass run inside it
    assert len(pauses) == 2 * (layers - 1), (len(pauses), layers)
    np.testing.assert_allclose(paused_bulk, plain_bulk, rtol=0, atol=1e-6)
    np.testing.assert_allclose(inside[0], plain_query, rtol=0, atol=1e-6)


class LayeredEngine:
    """A stand-in engine of LAYERS steps with the batch manager's pause between them. A batch whose
    first input starts with HOLD waits at its first boundary until `release` is set, so the test can
    queue a query while it is 'running'."""

    LAYERS = 4
    HOLD = 999
    HOLD_NEXT = 998  # held the same way, on its own events

    def __init__(self) -> None:
        self.pause = lambda: None
        self.release = threading.Event()
        self.at_boundary = threading.Event()
        self.release_next = threading.Event()
        self.at_boundary_next = threading.Event()
        self.log: list[str] = []

    def __call__(self, batch: list) -> np.ndarray:
        first = batch[0][0]
        name = {self.HOLD: "bulk", self.HOLD_NEXT: "next"}.get(first, f"batch{first}")
        self.log.append(f"{name}:start")
        for layer in range(1, self.LAYERS):
            if layer == 1 and first in (self.HOLD, self.HOLD_NEXT):
                at, release = (self.at_boundary, self.release) if first == self.HOLD else \
                    (self.at_boundary_next, self.release_next)
                at.set()
                assert release.wait(PATIENCE_S), "the test never released the bulk batch"
            self.pause()
        self.log.append(f"{name}:end")
        return np.array([[len(x), x[-1]] for x in batch], dtype=np.float32)


def run_scenario(scenario, preemptible: bool = True, max_requests: int = 32) -> tuple[LayeredEngine, RuntimeMetrics]:
    engine = LayeredEngine()
    metrics = RuntimeMetrics()

    async def main() -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="engine") as pool:
            bm = BatchManager(engine, 16384, max_requests, 10**6, metrics.for_model("m"), pool)
            if preemptible:
                engine.pause = bm.preempt_point
                bm.preemptible_in(LayeredEngine.LAYERS)
            bm.start()
            try:
                await scenario(bm, engine)
            finally:
                engine.release.set()
                engine.release_next.set()
                await bm.stop()

    asyncio.run(main())
    return engine, metrics


POLLS = 10_000  # at 1 ms apart: only so that a broken hand-over fails instead of hanging


async def until(condition) -> None:
    """Give the loop and the engine thread turns until `condition()` holds."""
    for _ in range(POLLS):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def counter(metrics: RuntimeMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model": "m"}) or 0.0


def test_a_query_runs_at_the_bulk_batchs_next_pause_and_is_answered_first():
    async def scenario(bm: BatchManager, engine: LayeredEngine) -> None:
        bulk = bm.submit([[LayeredEngine.HOLD, 1], [LayeredEngine.HOLD, 2]], urgent=False)
        await until(engine.at_boundary.is_set)  # the bulk batch is on the engine, held at a boundary
        # admission: a query waits for one layer of the bulk batch, bulk work for all of it
        assert (bm.ahead_of(urgent=True), bm.ahead_of(urgent=False)) == (1, 4)
        query = bm.submit([[7, 3]], urgent=True)
        answered: list[str] = []
        query.future.add_done_callback(lambda _: answered.append("query"))
        bulk.future.add_done_callback(lambda _: answered.append("bulk"))
        await until(lambda: bm._posted is not None)  # the loop planned it for the next pause
        engine.release.set()
        rows = await asyncio.wait_for(query.future, PATIENCE_S)
        assert rows.tolist() == [[2.0, 3.0]]
        assert (await asyncio.wait_for(bulk.future, PATIENCE_S)).tolist() == [[2.0, 1.0], [2.0, 2.0]]
        assert engine.log == ["bulk:start", "batch7:start", "batch7:end", "bulk:end"]
        assert answered == ["query", "bulk"]
        for _ in range(3):
            await asyncio.sleep(0)  # bookkeeping turns
        busy = bm.metrics.engine_busy._value.get()
        assert bulk.inference_s + query.inference_s == pytest.approx(busy), "each batch's own time, once"
        assert bm.queued_tokens == 0 and bm.ahead_of(True) == 0

    _, metrics = run_scenario(scenario)
    assert counter(metrics, "embedfleet_preempted_batches_total") == 1


def test_a_query_posted_after_the_last_pause_goes_before_the_bulk_answer():
    """The bulk batch ends before reaching another boundary: the posted query still runs (before the
    bulk batch's rows go back), and nothing is lost."""
    async def scenario(bm: BatchManager, engine: LayeredEngine) -> None:
        engine.pause = lambda: None  # no boundary takes it: only the end of the batch can
        bulk = bm.submit([[LayeredEngine.HOLD, 1]], urgent=False)
        await until(engine.at_boundary.is_set)
        query = bm.submit([[7, 3]], urgent=True)
        await until(lambda: bm._posted is not None)
        engine.release.set()
        assert (await asyncio.wait_for(query.future, PATIENCE_S)).tolist() == [[2.0, 3.0]]
        assert (await asyncio.wait_for(bulk.future, PATIENCE_S)).tolist() == [[2.0, 1.0]]
        assert engine.log == ["bulk:start", "bulk:end", "batch7:start", "batch7:end"]

    run_scenario(scenario)


@pytest.mark.parametrize(("held_urgent", "preemptible"), [(True, True), (False, False)],
                         ids=["query-behind-a-query", "preemption-off"])
def test_a_query_waits_for_the_whole_batch_when_it_may_not_pause(held_urgent, preemptible):
    """Only bulk batches pause for queries; with preemption off a query waits for the bulk batch."""
    async def scenario(bm: BatchManager, engine: LayeredEngine) -> None:
        held = bm.submit([[LayeredEngine.HOLD, 1]], urgent=held_urgent)
        await until(engine.at_boundary.is_set)
        query = bm.submit([[7, 3]], urgent=True)
        for _ in range(5):
            await asyncio.sleep(0)
        assert bm._posted is None, "the held batch was paused for the query"
        engine.release.set()
        await asyncio.wait_for(asyncio.gather(held.future, query.future), PATIENCE_S)
        assert engine.log == ["bulk:start", "bulk:end", "batch7:start", "batch7:end"]

    _, metrics = run_scenario(scenario, preemptible=preemptible)
    assert counter(metrics, "embedfleet_preempted_batches_total") == 0


def test_a_failing_query_batch_in_a_pause_fails_only_the_query():
    class Failing(LayeredEngine):
        def __call__(self, batch: list) -> np.ndarray:
            if batch[0][0] == 7:
                raise RuntimeError("engine broke on the query")
            return super().__call__(batch)

    engine = Failing()
    metrics = RuntimeMetrics()

    async def main() -> None:
        with ThreadPoolExecutor(1, thread_name_prefix="engine") as pool:
            bm = BatchManager(engine, 16384, 32, 10**6, metrics.for_model("m"), pool)
            engine.pause = bm.preempt_point
            bm.preemptible_in(LayeredEngine.LAYERS)
            bm.start()
            try:
                bulk = bm.submit([[LayeredEngine.HOLD, 1]], urgent=False)
                await until(engine.at_boundary.is_set)
                query = bm.submit([[7, 3]], urgent=True)
                await until(lambda: bm._posted is not None)
                engine.release.set()
                with pytest.raises(RuntimeError, match="broke on the query"):
                    await asyncio.wait_for(query.future, PATIENCE_S)
                assert (await asyncio.wait_for(bulk.future, PATIENCE_S)).tolist() == [[2.0, 1.0]]
                after = bm.submit([[8, 5]], urgent=True)  # and the manager keeps serving
                assert (await asyncio.wait_for(after.future, PATIENCE_S)).tolist() == [[2.0, 5.0]]
            finally:
                engine.release.set()
                engine.release_next.set()
                await bm.stop()

    asyncio.run(main())
    assert counter(metrics, "embedfleet_engine_failures_total") == 1, "the failed batch in the pause is counted"
    assert counter(metrics, "embedfleet_preempted_batches_total") == 1


BULK = [[101] + [2000 + (i * 37 + k) % 5000 for k in range(248)] + [102] for i in range(32)]  # 32 x 250 tokens
QUERY = "how do I reset my password"


def bulk_then_query(srv) -> tuple[list[str], httpx.Response, httpx.Response]:
    """A bulk request of one long batch, and a query sent once that batch is on the engine; returns the
    order they were answered in and both answers."""
    answered: list[str] = []
    got: dict[str, httpx.Response] = {}

    def send_bulk() -> None:
        with srv.client() as c:
            got["bulk"] = c.post("/v1/embeddings", json={"input": BULK}, headers={"x-priority": "bulk"})
        answered.append("bulk")

    sender = threading.Thread(target=send_bulk)
    sender.start()
    with srv.client() as c:
        for _ in range(POLLS):  # the bulk request is admitted and its batch taken off the queue: it is on the engine
            load = c.get("/load").json()
            (model,) = load["models"].values()
            if load["in_flight"] == 1 and model["queue_tokens"] == 0:
                break
            assert sender.is_alive(), ("the bulk request was answered before it was seen running", load)
            time.sleep(0.005)
        else:
            raise AssertionError(f"the bulk request never reached the engine: {load}")
        got["query"] = c.post("/v1/embeddings", json={"input": QUERY})
        answered.append("query")
    sender.join(PATIENCE_S * 12)
    return answered, got["bulk"], got["query"]


def test_a_query_sent_during_a_long_bulk_batch_is_answered_first(runtime_factory):
    """One bulk batch of 8,000 tokens (seconds of two CPU cores): the query does not wait for it. The bulk
    answer is the same as the same request's when nothing pauses it; with --no-preempt-bulk the query
    waits for the whole bulk batch."""
    flags = ("--bulk-batch-seconds", "0", "--max-batch-tokens", "8192", "--max-batch-requests", "32")
    srv = runtime_factory(*flags)
    order, bulk, query = bulk_then_query(srv)
    assert bulk.status_code == 200 and query.status_code == 200, (bulk.text[:200], query.text[:200])
    assert order == ["query", "bulk"]
    assert srv.metric("embedfleet_preempted_batches_total") == 1
    assert srv.metric("embedfleet_batch_size_count") == 2, "one bulk batch, and the query in its pause"
    with srv.client() as c:
        alone = c.post("/v1/embeddings", json={"input": BULK}, headers={"x-priority": "bulk"})
    assert srv.metric("embedfleet_preempted_batches_total") == 1  # nothing paused this one
    paused_rows = np.array([d["embedding"] for d in bulk.json()["data"]])
    np.testing.assert_allclose(paused_rows, np.array([d["embedding"] for d in alone.json()["data"]]),
                               rtol=0, atol=1e-6)

    # The query's bound far out: without preemption it waits for the whole bulk batch, which on a loaded
    # machine is more than the default 5 s, and admission rightly refuses it 429 up front. What is tested
    # here is that it waits, not the bound.
    srv = runtime_factory(*flags, "--no-preempt-bulk", "--max-queue-seconds", "3600")
    order, bulk, query = bulk_then_query(srv)
    assert bulk.status_code == 200 and query.status_code == 200
    # The query waited for the bulk batch, as the server timed it. (Not the order the two clients finished
    # reading in: the query's own batch takes milliseconds, less than the bulk client's parse of its
    # answer on busy cores.) It was sent once the batch was on the engine, so it queued for most of it.
    waited_ms, bulk_ms = int(query.headers["x-queue-time"]), int(bulk.headers["x-inference-time"])
    assert waited_ms >= 0.5 * bulk_ms, (order, waited_ms, bulk_ms)
    assert srv.metric("embedfleet_preempted_batches_total") == 0


def test_the_next_bulk_batch_waits_on_the_engine_thread_and_a_query_still_goes_at_the_next_pause():
    """With a bulk batch running, the next bulk batch is handed to the engine thread at once (it starts
    when the running one ends, without waiting for the loop); bulk admission counts it, a query's does
    not: a query posted meanwhile runs at the running batch's next pause, before the handed-over batch."""
    async def scenario(bm: BatchManager, engine: LayeredEngine) -> None:
        first = bm.submit([[LayeredEngine.HOLD, 1], [LayeredEngine.HOLD, 2]], urgent=False)
        second = bm.submit([[5, 1], [5, 2]], urgent=False)  # two inputs a batch: the next batch
        await until(engine.at_boundary.is_set)
        assert bm._next is not None and bm.queued_tokens == 0, "the second batch is on the engine thread"
        # a query waits for one layer of the running batch (4 tokens / 4 layers); bulk work for both batches
        assert (bm.ahead_of(urgent=True), bm.ahead_of(urgent=False)) == (1, 8)
        query = bm.submit([[7, 3]], urgent=True)
        await until(lambda: bm._posted is not None)
        engine.release.set()
        assert (await asyncio.wait_for(query.future, PATIENCE_S)).tolist() == [[2.0, 3.0]]
        assert (await asyncio.wait_for(first.future, PATIENCE_S)).tolist() == [[2.0, 1.0], [2.0, 2.0]]
        assert (await asyncio.wait_for(second.future, PATIENCE_S)).tolist() == [[2.0, 1.0], [2.0, 2.0]]
        assert engine.log == ["bulk:start", "batch7:start", "batch7:end", "bulk:end", "batch5:start", "batch5:end"]
        for _ in range(3):
            await asyncio.sleep(0)  # bookkeeping turns
        assert bm.idle and bm.ahead_of(False) == 0

    run_scenario(scenario, max_requests=2)


def test_a_handed_over_bulk_batch_pauses_for_queries_from_its_start():
    """The running batch hands its acceptance of queries' batches over to the bulk batch waiting behind
    it: a query arriving once that one runs is run at its next pause, not after it."""
    async def scenario(bm: BatchManager, engine: LayeredEngine) -> None:
        first = bm.submit([[LayeredEngine.HOLD, 1], [LayeredEngine.HOLD, 2]], urgent=False)
        second = bm.submit([[LayeredEngine.HOLD_NEXT, 1], [LayeredEngine.HOLD_NEXT, 2]], urgent=False)
        await until(engine.at_boundary.is_set)
        engine.release.set()
        await until(engine.at_boundary_next.is_set)  # the handed-over batch runs, held at a boundary
        await asyncio.wait_for(first.future, PATIENCE_S)
        await until(lambda: bm._next is None and bm._running_tokens == 4)  # the loop saw the hand-over
        assert (bm.ahead_of(urgent=True), bm.ahead_of(urgent=False)) == (1, 4)
        query = bm.submit([[7, 3]], urgent=True)
        await until(lambda: bm._posted is not None)
        engine.release_next.set()
        assert (await asyncio.wait_for(query.future, PATIENCE_S)).tolist() == [[2.0, 3.0]]
        assert (await asyncio.wait_for(second.future, PATIENCE_S)).tolist() == [[2.0, 1.0], [2.0, 2.0]]
        assert engine.log == ["bulk:start", "bulk:end", "next:start", "batch7:start", "batch7:end", "next:end"]

    _, metrics = run_scenario(scenario, max_requests=2)
    assert counter(metrics, "embedfleet_preempted_batches_total") == 1


def test_nothing_is_handed_over_early_while_a_queued_request_has_a_deadline():
    """Only queued work is dropped when its deadline passes (504, never run): a bulk request with a
    deadline stays queued behind the running bulk batch, and bulk work queued beside it too."""
    async def scenario(bm: BatchManager, engine: LayeredEngine) -> None:
        first = bm.submit([[LayeredEngine.HOLD, 1], [LayeredEngine.HOLD, 2]], urgent=False)
        timed = bm.submit([[5, 1], [5, 2]], urgent=False, deadline=time.monotonic() + 60)
        await until(engine.at_boundary.is_set)
        other = bm.submit([[6, 1], [6, 2]], urgent=False)
        for _ in range(3):
            await asyncio.sleep(0)  # the loop turns in which a hand-over would be planned
        assert bm._next is None and bm.queued_tokens == 8, "both still queued"
        engine.release.set()
        for job in (first, timed, other):
            await asyncio.wait_for(job.future, PATIENCE_S)
        assert engine.log == ["bulk:start", "bulk:end", "batch5:start", "batch5:end", "batch6:start", "batch6:end"]
        assert bm._deadline_jobs == 0

    run_scenario(scenario, max_requests=2)
