"""What the batch manager and the response bodies hand back, whatever way the work was cut into batches:
each request's rows in input order, and base64 that decodes to the same float32 as the vectors."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.api.bodies import base64_rows, embeddings_body
from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.metrics import RuntimeMetrics

PATIENCE_S = 10


def rows_of(batch: list) -> np.ndarray:
    """[its length, its first token, its last token]: a row says which input of which request it is."""
    return np.array([[len(ids), ids[0], ids[-1]] for ids in batch], dtype=np.float32)


def run(scenario, max_requests: int, engine=rows_of, packed: bool = False) -> None:
    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            bm = BatchManager(engine, 16384, max_requests, 10**7, RuntimeMetrics().for_model("m"), pool,
                              packed=packed)
            bm.start()
            await asyncio.sleep(0)
            try:
                await scenario(bm)
            finally:
                await bm.stop()

    asyncio.run(main())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=40), min_size=1, max_size=6),
       st.integers(1, 16), st.randoms(use_true_random=False), st.booleans())
def test_rows_come_back_in_input_order_however_the_batches_cut_the_requests(requests, max_requests, rng, packed):
    """Requests of mixed lengths, batches of a few inputs: the planner takes inputs by length (or, for a
    packed engine, oldest first, skipping what does not fit), so a request's inputs arrive out of order,
    spread over batches beside other requests'. Each gets exactly its rows."""
    seen: list[int] = []

    def engine(batch: list) -> np.ndarray:
        seen.append(len(batch))
        return rows_of(batch)

    async def scenario(bm: BatchManager) -> None:
        jobs, wanted = [], []
        for r, lengths in enumerate(requests):
            inputs = [[r] + [1000 + i] * (n - 1) if n > 1 else [r] for i, n in enumerate(lengths)]
            wanted.append(rows_of(inputs))
            jobs.append(bm.submit(inputs, urgent=rng.random() < 0.5))
        for job, want in zip(jobs, wanted, strict=True):
            got = await asyncio.wait_for(job.future, PATIENCE_S)
            np.testing.assert_array_equal(got, want)
        assert bm.queued_tokens == 0 and not bm._queue and bm._queued_jobs == 0

    run(scenario, max_requests, engine, packed)
    assert sum(seen) == sum(map(len, requests))


def test_a_packed_engine_gets_a_request_of_mixed_lengths_in_one_batch():
    """What the padded plan cuts into batches of like lengths, a packed engine (which pays for real tokens
    only) gets whole: one hand-over, one answer, instead of one per length group."""
    for packed, most in ((False, 2), (True, 1)):
        seen: list[int] = []

        def engine(batch: list, seen=seen) -> np.ndarray:
            seen.append(len(batch))
            return rows_of(batch)

        async def scenario(bm: BatchManager) -> None:
            inputs = [[7] * (8 if i % 2 else 200) for i in range(24)]
            rows = await asyncio.wait_for(bm.submit(inputs, urgent=False).future, PATIENCE_S)
            np.testing.assert_array_equal(rows, rows_of(inputs))

        run(scenario, 32, engine, packed)
        assert sum(seen) == 24 and (len(seen) == most if packed else len(seen) >= most), (packed, seen)


def test_a_lone_query_gets_a_view_of_the_batch_and_a_split_request_one_array():
    batches: list[np.ndarray] = []

    def engine(batch: list) -> np.ndarray:
        batches.append(rows_of(batch))
        return batches[-1]

    async def scenario(bm: BatchManager) -> None:
        query = bm.submit([[5, 6]], urgent=True)
        row = await asyncio.wait_for(query.future, PATIENCE_S)
        assert row.shape == (1, 3) and np.shares_memory(row, batches[0]), "no copy on the single query's path"
        split = bm.submit([[1] * 200, [2] * 3, [3] * 190, [4] * 4], urgent=True)  # two batches of two
        rows = await asyncio.wait_for(split.future, PATIENCE_S)
        assert rows[:, 1].tolist() == [1, 2, 3, 4] and rows.dtype == np.float32 and rows.flags.c_contiguous

    run(scenario, max_requests=2, engine=engine)


def test_ragged_rows_are_each_requests_list_in_input_order():
    def engine(batch: list) -> list[np.ndarray]:
        return [np.full((len(ids), 2), ids[0], np.float32) for ids in batch]

    async def scenario(bm: BatchManager) -> None:
        job = bm.submit([[7] * 50, [8] * 2, [9] * 40], urgent=True)
        got = await asyncio.wait_for(job.future, PATIENCE_S)
        assert [(len(a), a[0, 0]) for a in got] == [(50, 7), (2, 8), (40, 9)]

    run(scenario, max_requests=1, engine=engine)


@given(st.integers(1, 9), st.integers(1, 130))
def test_base64_rows_decode_to_the_vectors_float32(count, width):
    """Widths divisible by 3 take the one-encoding path, the others the per-row one: both as OpenAI's."""
    vectors = np.random.default_rng(count * 1000 + width).standard_normal((count, width)).astype(np.float32)
    encoded = base64_rows(vectors)
    assert len(encoded) == count
    for text, vector in zip(encoded, vectors, strict=True):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(text), dtype="<f4"), vector)


def test_embeddings_body_float_and_base64_agree():
    rows = np.random.default_rng(1).standard_normal((5, 384)).astype(np.float32)
    as_float = embeddings_body("m", rows, 42, None, "float")
    as_b64 = embeddings_body("m", rows, 42, 96, "base64")
    assert [d["index"] for d in as_float["data"]] == list(range(5)) and as_float["usage"]["total_tokens"] == 42
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    np.testing.assert_allclose(np.array([d["embedding"] for d in as_float["data"]]), unit, atol=1e-6)
    short = rows[:, :96] / np.linalg.norm(rows[:, :96], axis=1, keepdims=True)
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in as_b64["data"]])
    np.testing.assert_allclose(decoded, short, atol=1e-6)
