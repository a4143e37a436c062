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


def counting_pool(workers: int) -> TokenizerPool:
    pool = TokenizerPool(load_spec(default_model_dir()).path / "tokenizer.json", workers)
    pool.tokenizer = Counting(pool.tokenizer)  # type: ignore[assignment]
    return pool


@pytest.fixture
def pool() -> Iterator[TokenizerPool]:
    pool = counting_pool(1)
    yield pool
    pool.close()


def alone(pool: TokenizerPool, texts: list[str], limit: int, truncate: bool = True,
          direction: tokenize.Direction = "right") -> list[Tokenized]:
    return pool._encode_sync(texts, limit, truncate, direction)


async def queued_behind_a_busy_thread(pool: TokenizerPool, calls: list[tuple], merge: bool = True) -> list:
    """Hold the pool's threads, queue `calls` (encode's arguments), let them go: their outcomes in order."""
    held, go = threading.Semaphore(0), threading.Event()
    for _ in range(pool._workers):
        pool._pool.submit(lambda: (held.release(), go.wait(30)))
    for _ in range(pool._workers):
        held.acquire(timeout=30)
    tasks = [asyncio.create_task(pool.encode(*call, merge=merge)) for call in calls]
    while merge and len(pool._pending) < len(calls):
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
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
        gone = asyncio.create_task(pool.encode(TEXTS[:4], 512, merge=True))
        kept = asyncio.create_task(pool.encode(TEXTS[4:8], 512, merge=True))
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
        waiting = [asyncio.create_task(pool.encode(TEXTS[:4], 512, merge=True)) for _ in range(3)]
        while len(pool._pending) < 3:
            await asyncio.sleep(0.001)
        pool.close()
        go.set()
        done, _ = await asyncio.wait(waiting, timeout=10)
        with pytest.raises(RuntimeError):
            await pool.encode(TEXTS[:4], 512, merge=True)
        return [task.cancelled() for task in done]

    assert asyncio.run(run()) == [True, True, True]
    assert not pool._pending


def test_urgent_calls_are_never_merged(pool: TokenizerPool) -> None:
    """What ModelService.tokenize sends for a request of a few inputs: tokenized alone, as before merging."""
    calls = [(TEXTS[:3], 512), (TEXTS[3:6], 512), (TEXTS[6:9], 512)]
    answers = asyncio.run(queued_behind_a_busy_thread(pool, calls, merge=False))
    assert pool.tokenizer.batches == [3, 3, 3]
    assert answers == [alone(pool, *call) for call in calls]


def test_a_call_of_many_characters_goes_alone(pool: TokenizerPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch is also capped in characters, so a small call never waits for a large one's texts."""
    monkeypatch.setattr(tokenize, "MERGE_CHARS", 300)
    small, large = TEXTS[:2], [" ".join(["word"] * 80)] * 2  # the large call alone is over the cap
    calls = [(small, 512), (large, 512), (small, 512), (small, 512)]
    answers = asyncio.run(queued_behind_a_busy_thread(pool, calls))
    assert pool.tokenizer.batches == [2, 2, 4], "the large call went alone and nothing joined it"
    assert answers == [alone(pool, *call) for call in calls]


def test_each_thread_takes_its_share_of_the_queue() -> None:
    """Two threads, four calls queued: the first turn takes half of them, not all, and the other thread the
    rest (with the tokenizer's own parallelism off, one batch of everything would run on one core)."""
    pool = counting_pool(2)
    try:
        calls = [(TEXTS[i:i + 3], 512) for i in range(0, 12, 3)]
        answers = asyncio.run(queued_behind_a_busy_thread(pool, calls))
        batches = pool.tokenizer.batches
        assert batches[0] == 6 and sum(batches) == 12 and len(batches) >= 2, batches
        assert answers == [alone(pool, *call) for call in calls]
    finally:
        pool.close()


class Panic(BaseException):
    """As HF tokenizers' PanicException, a BaseException: raised for one text the tokenizer cannot take."""


def test_a_text_the_tokenizer_cannot_take_fails_its_own_call_alone(pool: TokenizerPool) -> None:
    counting = pool.tokenizer
    poison = "this text makes the tokenizer panic"

    def encode_batch_fast(texts):
        counting.batches.append(len(texts))
        if poison in texts:
            raise Panic("bad split")
        return counting.tokenizer.encode_batch_fast(texts)

    counting.encode_batch_fast = encode_batch_fast
    calls = [(TEXTS[:3], 512), (["fine", poison], 512), (TEXTS[3:6], 512)]
    first, failed, last = asyncio.run(queued_behind_a_busy_thread(pool, calls))
    assert isinstance(failed, Panic)
    assert counting.batches == [8, 3, 2, 3], "the merged batch failed, then each call ran alone"
    assert first == alone(pool, *calls[0]) and last == alone(pool, *calls[2])


def test_an_unexpected_error_answers_its_call_and_nobody_hangs(pool: TokenizerPool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cut = TokenizerPool._cut

    def failing_cut(encodings, limit, truncate, direction):
        if limit == 7:
            raise MemoryError("no room")
        return cut(encodings, limit, truncate, direction)

    monkeypatch.setattr(TokenizerPool, "_cut", staticmethod(failing_cut))
    calls = [(TEXTS[:3], 7), (TEXTS[3:6], 512)]
    failed, kept = asyncio.run(asyncio.wait_for(queued_behind_a_busy_thread(pool, calls), 10))
    assert isinstance(failed, MemoryError)
    assert kept == alone(pool, *calls[1])
