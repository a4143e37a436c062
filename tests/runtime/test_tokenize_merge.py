"""Calls that wait for a tokenizer thread together are tokenized in one batch (core/tokenize.py, encode): each
still gets its own ids, limit, truncation and errors, a caller that left is skipped, and closing the pool
leaves nobody waiting. The real default model's tokenizer, one thread held busy so that calls queue."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from embedfleet.runtime.core import tokenize
from embedfleet.runtime.core.tokenize import InputTooLong, Tokenized, TokenizerPool
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir

TEXTS = [f"passage {i}: " + " ".join(["alpha", "beta", "gamma"] * (1 + i % 7)) for i in range(40)]


class Counting:
    """The pool's tokenizer, counting its batch calls (the Rust object's methods cannot be patched)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.batches: list[int] = []

    def encode_batch_fast(self, texts):
        self.batches.append(len(texts))
        return self.tokenizer.encode_batch_fast(texts)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture
def pool() -> Iterator[TokenizerPool]:
    pool = TokenizerPool(load_spec(default_model_dir()).path / "tokenizer.json", 1)
    pool.tokenizer = Counting(pool.tokenizer)  # type: ignore[assignment]
    yield pool
    pool.close()


def alone(pool: TokenizerPool, texts: list[str], limit: int, truncate: bool = True,
          direction: tokenize.Direction = "right") -> list[Tokenized]:
    return pool._encode_sync(texts, limit, truncate, direction)


async def queued_behind_a_busy_thread(pool: TokenizerPool, calls: list[tuple]) -> list:
    """Hold the pool's one thread, queue `calls` (encode's arguments), let it go: their outcomes in order."""
    held, go = threading.Event(), threading.Event()
    pool._pool.submit(lambda: (held.set(), go.wait(30)))
    held.wait(30)
    tasks = [asyncio.create_task(pool.encode(*call)) for call in calls]
    while len(pool._pending) < len(calls):
        await asyncio.sleep(0.001)
    go.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_calls_queued_together_are_one_batch_with_their_own_answers(pool: TokenizerPool) -> None:
    calls = [(TEXTS[:5], 512, True, "right"), (TEXTS[5:17], 8, True, "left"), (TEXTS[17:30], 6, True, "right")]
    answers = asyncio.run(queued_behind_a_busy_thread(pool, calls))
    assert pool.tokenizer.batches == [30], "the three calls were tokenized in one batch"
    for call, answer in zip(calls, answers, strict=True):
        assert answer == alone(pool, *call), "each call gets what it would have got alone"
    assert all(len(t) <= 8 for t in answers[1]) and any(t.truncated for t in answers[1])


def test_one_calls_input_too_long_fails_that_call_alone(pool: TokenizerPool) -> None:
    calls = [(TEXTS[:3], 512, True, "right"), (TEXTS[3:6], 4, False, "right"), (TEXTS[6:9], 512, True, "right")]
    first, refused, last = asyncio.run(queued_behind_a_busy_thread(pool, calls))
    assert isinstance(refused, InputTooLong) and refused.index == 0
    assert first == alone(pool, *calls[0]) and last == alone(pool, *calls[2])


def test_a_batch_takes_calls_up_to_the_cap_and_the_rest_goes_next(pool: TokenizerPool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenize, "MERGE_TEXTS", 10)
    calls = [(TEXTS[:6], 512), (TEXTS[6:10], 512), (TEXTS[10:14], 512), (TEXTS[14:30], 512)]
    answers = asyncio.run(queued_behind_a_busy_thread(pool, calls))
    assert pool.tokenizer.batches == [10, 4, 16], "a first call over the cap still goes, alone"
    assert answers == [alone(pool, *call) for call in calls]


def test_a_caller_that_left_is_skipped(pool: TokenizerPool) -> None:
    async def run() -> list:
        held, go = threading.Event(), threading.Event()
        pool._pool.submit(lambda: (held.set(), go.wait(30)))
        held.wait(30)
        gone = asyncio.create_task(pool.encode(TEXTS[:4], 512))
        kept = asyncio.create_task(pool.encode(TEXTS[4:8], 512))
        while len(pool._pending) < 2:
            await asyncio.sleep(0.001)
        gone.cancel()
        await asyncio.sleep(0)
        go.set()
        return [await kept, gone.cancelled()]

    kept, cancelled = asyncio.run(run())
    assert pool.tokenizer.batches == [4], "nothing was tokenized for the caller that left"
    assert cancelled and kept == alone(pool, TEXTS[4:8], 512)


def test_closing_the_pool_leaves_nobody_waiting(pool: TokenizerPool) -> None:
    async def run() -> list:
        held, go = threading.Event(), threading.Event()
        pool._pool.submit(lambda: (held.set(), go.wait(30)))
        held.wait(30)
        waiting = [asyncio.create_task(pool.encode(TEXTS[:4], 512)) for _ in range(3)]
        while len(pool._pending) < 3:
            await asyncio.sleep(0.001)
        pool.close()
        go.set()
        done, _ = await asyncio.wait(waiting, timeout=10)
        with pytest.raises(RuntimeError):
            await pool.encode(TEXTS[:4], 512)
        return [task.cancelled() for task in done]

    assert asyncio.run(run()) == [True, True, True]
    assert not pool._pending
