"""The engine thread (core/engine_thread.py): one thread, calls in order, errors kept where they belong."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from embedfleet.runtime.core.engine_thread import EngineThread


def test_posted_and_submitted_calls_run_in_order_on_one_thread():
    thread = EngineThread("engine-test")
    seen: list[tuple[int, int]] = []
    try:
        for i in range(50):
            if i % 2:
                thread.post(lambda i=i: seen.append((i, threading.get_ident())))
            else:
                thread.submit(lambda i=i: seen.append((i, threading.get_ident())))
        assert thread.submit(lambda: "last").result(timeout=10) == "last"
    finally:
        thread.shutdown()
    assert [i for i, _ in seen] == list(range(50))
    idents = {ident for _, ident in seen}
    assert len(idents) == 1 and threading.get_ident() not in idents


def test_errors_reach_the_future_and_a_failing_post_does_not_end_the_thread(caplog):
    thread = EngineThread("engine-test")
    try:
        def boom():
            raise ValueError("no such shape")

        with pytest.raises(ValueError, match="no such shape"):
            thread.submit(boom).result(timeout=10)
        thread.post(boom)  # logged, and the thread goes on
        assert thread.submit(lambda a, b=0: a + b, 2, b=3).result(timeout=10) == 5
    finally:
        thread.shutdown()
    assert "uncaught error in a call on the engine thread" in caplog.text


def test_run_in_executor_and_shutdown():
    thread = EngineThread("engine-test")

    async def scenario() -> int:
        return await asyncio.get_running_loop().run_in_executor(thread, sum, [1, 2, 3])

    assert asyncio.run(scenario()) == 6
    ran = threading.Event()
    thread.post(ran.set)
    thread.shutdown(wait=True)  # what was handed over before still runs
    assert ran.is_set()
    with pytest.raises(RuntimeError):
        thread.submit(sum, [1])
    with pytest.raises(RuntimeError):
        thread.post(sum, [1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_the_engine_and_tokenizer_threads_carry_their_names_where_the_os_shows_them() -> None:
    """`top -H`, py-spy and the benches (bench/_common.py) tell the server's threads apart by these names."""
    from embedfleet.runtime.core.tokenize import TokenizerPool
    from embedfleet.runtime.settings import default_model_dir

    def comm() -> str:
        return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    engine = EngineThread("engine-m")
    pool = TokenizerPool(default_model_dir() / "tokenizer.json", 1)
    try:
        assert engine.submit(comm).result(timeout=10) == "engine"
        assert pool._pool.submit(comm).result(timeout=10) == "tokenizer"
        assert comm() != "engine"  # the caller's own name is left alone
    finally:
        engine.shutdown()
        pool.close()
