"""The kit's work queue (embedfleet/kit/workqueue.py): keys deduplicated, never held by two workers, re-queued
when added mid-work, backed off per key, delayed, drained by workers that retry failures; and its metrics."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from embedfleet.kit.workqueue import Result, Workers, WorkQueue, backoff, prometheus_metrics


@given(failures=st.integers(1, 200), base=st.floats(0.001, 1.0), cap=st.floats(0.001, 600.0))
def test_backoff_doubles_up_to_its_cap(failures: int, base: float, cap: float) -> None:
    delay = backoff(failures, base, cap)
    assert 0 < delay <= cap
    assert backoff(failures + 1, base, cap) >= delay
    if delay < cap:
        assert delay == pytest.approx(base * 2 ** (failures - 1))


ops = st.lists(st.tuples(st.sampled_from(["add", "get", "done"]), st.sampled_from("abcd")), max_size=60)


@settings(max_examples=300)
@given(ops)
def test_the_queue_matches_a_model_of_dedupe_and_requeue(steps: list[tuple[str, str]]) -> None:
    """Single-threaded against a model: a key is handed out at most once at a time, a waiting key is never
    duplicated, and a key added while held comes back after done."""
    queue = WorkQueue("model")
    waiting: list[str] = []
    held: set[str] = set()
    again: set[str] = set()
    for op, key in steps:
        if op == "add":
            queue.add(key)
            if key in held:
                again.add(key)
            elif key not in waiting:
                waiting.append(key)
        elif op == "get":
            got = queue.get(timeout=0)
            expected = waiting.pop(0) if waiting else None
            assert got == expected
            if got is not None:
                held.add(got)
        elif key in held:
            queue.done(key)
            held.discard(key)
            if key in again:
                again.discard(key)
                waiting.append(key)
        assert len(queue) == len(waiting)
    queue.shutdown()


def test_a_failing_key_backs_off_and_a_success_forgets() -> None:
    queue = WorkQueue("backoff", base_delay=0.5, max_delay=2.0)
    queue.add_rate_limited("k")
    assert queue.get(timeout=0) is None, "not before its back-off"
    assert queue.get(timeout=5) == "k"
    queue.done("k")
    queue.add_rate_limited("k")
    queue.add_rate_limited("k")
    assert queue.failures("k") == 3
    queue.forget("k")
    assert queue.failures("k") == 0
    queue.shutdown()


def test_delayed_keys_come_in_due_order_and_shutdown_ends_get() -> None:
    queue = WorkQueue("delays")
    queue.add_after("late", 1.0)  # apart by far more than a loaded machine delays the second add
    queue.add_after("soon", 0.05)
    assert queue.get(timeout=2) == "soon"
    assert queue.get(timeout=2) == "late"
    waiter: list[str | None] = []
    thread = threading.Thread(target=lambda: waiter.append(queue.get()))
    thread.start()
    time.sleep(0.05)
    queue.shutdown()
    thread.join(2)
    assert waiter == [None]


def test_a_delayed_key_waits_once_at_its_earliest_due_time() -> None:
    """Events that each ask for "placement in 0.2 s" while nothing drains the queue (a standby) keep one
    entry, not one per event; an earlier time moves it, a later one is ignored."""
    now = [0.0]
    queue = WorkQueue("coalesce", clock=lambda: now[0])
    for _ in range(1000):
        queue.add_after("placement", 0.2)
        now[0] += 0.0001
    assert len(queue._delayed) == 1
    queue.add_after("placement", 5.0)  # later: ignored
    queue.add_after("placement", 0.01)  # sooner: moved
    now[0] += 0.02
    assert queue.get(timeout=0) == "placement"
    queue.done("placement")
    now[0] += 10.0
    assert queue.get(timeout=0) is None  # the stale entries are dropped, not delivered again
    assert len(queue._delayed) == 0


def test_workers_never_run_one_key_twice_at_once_and_retry_failures() -> None:
    queue = WorkQueue("workers", base_delay=0.01, max_delay=0.05)
    running: Counter[str] = Counter()
    overlap: list[str] = []
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def reconcile(key: str) -> Result | None:
        with lock:
            running[key] += 1
            calls[key] += 1
            if running[key] > 1:
                overlap.append(key)
            failing = key == "flaky" and calls[key] <= 2
        time.sleep(0.005)
        with lock:
            running[key] -= 1
        if failing:
            raise RuntimeError("transient")
        return None

    workers = Workers(queue, reconcile, count=4).start()
    for _ in range(50):
        for key in ("a", "b", "flaky"):
            queue.add(key)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (calls["flaky"] < 3 or len(queue)):
        time.sleep(0.01)
    workers.stop()
    assert not overlap, f"keys held by two workers: {overlap}"
    assert calls["flaky"] >= 3 and queue.failures("flaky") == 0, "retried until it succeeded, then forgotten"
    assert calls["a"] < 50, "adds of a waiting key were merged"


def test_a_result_can_ask_to_look_again_later() -> None:
    queue = WorkQueue("requeue")
    seen: list[float] = []
    workers = Workers(queue, lambda key: seen.append(time.monotonic()) or Result(requeue_after=0.1)).start()
    queue.add("k")
    deadline = time.monotonic() + 3
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    workers.stop()
    assert len(seen) >= 3 and all(b - a >= 0.09 for a, b in itertools.pairwise(seen))


def test_prometheus_metrics_move() -> None:
    registry = CollectorRegistry()
    queue = WorkQueue("measured", metrics=prometheus_metrics("test", registry))
    # exported from the start, at zero: a dashboard's retries panel has a series before the first retry
    assert registry.get_sample_value("test_workqueue_retries_total", {"name": "measured"}) == 0
    assert registry.get_sample_value("test_workqueue_depth", {"name": "measured"}) == 0
    queue.add("a")
    queue.add("b")
    assert registry.get_sample_value("test_workqueue_depth", {"name": "measured"}) == 2
    key = queue.get(timeout=0)
    queue.done(key)
    queue.add_rate_limited("a")
    assert registry.get_sample_value("test_workqueue_adds_total", {"name": "measured"}) == 2
    assert registry.get_sample_value("test_workqueue_queue_seconds_count", {"name": "measured"}) == 1
    assert registry.get_sample_value("test_workqueue_work_seconds_count", {"name": "measured"}) == 1
    assert registry.get_sample_value("test_workqueue_retries_total", {"name": "measured"}) == 1
    queue.shutdown()
