"""The leader's shutdown (operator/embedfleet/operator/main.py `hand_over`, background.py `settle`): the
Lease is handed back only once handler threads, background workers and spoke writers have ended; work
still under way past the bound means no release (the Lease expires), so a standby that takes over at once
never acts beside a write of ours.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

from embedfleet.operator import background
from embedfleet.operator.main import hand_over


class Elector:
    """Records which of release/abandon was called, and when (monotonic)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def release(self) -> None:
        self.calls.append(("release", time.monotonic()))

    def abandon(self) -> None:
        self.calls.append(("abandon", time.monotonic()))


def test_the_lease_is_released_only_after_a_running_handler_ended() -> None:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    ended: list[float] = []
    pool.submit(lambda: (time.sleep(0.5), ended.append(time.monotonic())))
    elector = Elector()
    assert hand_over(elector, pool, timeout=5)  # type: ignore[arg-type]
    assert [c[0] for c in elector.calls] == ["release"]
    assert ended and elector.calls[0][1] >= ended[0]


def test_a_handler_still_running_past_the_bound_means_no_release() -> None:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    gate = threading.Event()
    pool.submit(gate.wait, 30)
    elector = Elector()
    try:
        started = time.monotonic()
        assert not hand_over(elector, pool, timeout=0.5)  # type: ignore[arg-type]
        assert time.monotonic() - started < 3
        assert [c[0] for c in elector.calls] == ["abandon"]
    finally:
        gate.set()


def test_a_tracked_pool_closed_without_waiting_is_waited_for() -> None:
    """The hub's spoke writer is closed with shutdown(wait=False): a write may still be under way."""
    pool = background.track_pool(concurrent.futures.ThreadPoolExecutor(1))
    gate = threading.Event()
    pool.submit(gate.wait, 30)
    pool.shutdown(wait=False, cancel_futures=True)
    elector = Elector()
    try:
        assert not hand_over(elector, timeout=0.3)  # type: ignore[arg-type]
        assert [c[0] for c in elector.calls] == ["abandon"]
    finally:
        gate.set()
    elector = Elector()
    assert hand_over(elector, timeout=5)  # type: ignore[arg-type]
    assert [c[0] for c in elector.calls] == ["release"]


def test_a_background_worker_that_does_not_stop_means_no_release() -> None:
    class Worker:
        def __init__(self) -> None:
            self.stop = threading.Event()
            self.go = threading.Event()

        def run_forever(self) -> None:
            self.go.wait(30)  # ignores `stop`: still writing

    slot: dict = {}
    worker = Worker()
    background.start_background(slot, worker, "stuck")
    try:
        background.stop_background(slot, timeout=0.1)
        elector = Elector()
        assert not hand_over(elector, timeout=0.3)  # type: ignore[arg-type]
        assert [c[0] for c in elector.calls] == ["abandon"]
    finally:
        worker.go.set()
        slot["thread"].join(5)
