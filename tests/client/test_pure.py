"""Pure decisions: batch planning, backoff, Retry-After, hedge budget, endpoint choice, decoding."""

from __future__ import annotations

import base64
import random

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.client.batching import plan_batches
from embedfleet.client.decode import decode_embeddings
from embedfleet.client.endpoints import Endpoint, pick_endpoint
from embedfleet.client.errors import BatchFailedError, FailedBatch, ResponseMismatchError
from embedfleet.client.retry import HedgeBudget, RetryPolicy, parse_retry_after


@given(
    st.lists(st.integers(1, 500), max_size=200),
    st.integers(1, 40),
    st.one_of(st.none(), st.integers(1, 2000)),
)
def test_batches_cover_inputs_in_order_within_limits(
    lengths: list[int], max_count: int, max_chars: int | None
):
    ranges = plan_batches(lengths, max_count, max_chars)
    flat = [i for s, e in ranges for i in range(s, e)]
    assert flat == list(range(len(lengths)))
    for s, e in ranges:
        assert 1 <= e - s <= max_count
        if max_chars is not None and e - s > 1:
            assert sum(lengths[s:e]) <= max_chars


def test_long_text_gets_its_own_batch():
    assert plan_batches([5, 100, 5], 10, 50) == [(0, 1), (1, 2), (2, 3)]


@given(st.integers(0, 20), st.one_of(st.none(), st.floats(0, 1000)), st.integers(0, 2**32))
def test_backoff_is_bounded_and_honours_retry_after(attempt: int, retry_after: float | None, seed: int):
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=4.0, max_retry_after=30.0)
    delay = policy.delay(attempt, retry_after, random.Random(seed))
    cap = min(4.0, 0.1 * 2**attempt)
    assert cap / 2 <= delay or (retry_after is not None and delay >= min(retry_after, 30.0))
    assert delay <= max(cap, min(retry_after or 0, 30.0))
    if retry_after is not None:
        assert delay >= min(retry_after, 30.0)


def test_parse_retry_after_forms():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("-4") == 0.0


@given(st.floats(0, 1), st.lists(st.booleans(), max_size=300))
def test_hedges_never_exceed_budget(fraction: float, events: list[bool]):
    budget = HedgeBudget(fraction)
    for is_primary in events:
        if is_primary:
            budget.record_primary()
        else:
            budget.try_acquire()
        assert budget.hedges <= fraction * budget.primaries + 1e-9


def test_pick_prefers_healthy_lowest_latency_and_honours_exclude():
    a, b, c = Endpoint("http://a", latency=0.3), Endpoint("http://b", latency=0.1), Endpoint("http://c")
    assert pick_endpoint([a, b, c], now=0).url == "http://b"
    b.healthy, b.unhealthy_since = False, 0.0
    assert pick_endpoint([a, b, c], now=1, recheck_after=5).url in ("http://a", "http://c")
    assert pick_endpoint([a, b, c], now=10, recheck_after=5).url == "http://b"  # half-open again
    assert pick_endpoint([a, b, c], now=1, exclude=["http://a", "http://c"]).url in ("http://a", "http://c")
    assert pick_endpoint([b], now=1).url == "http://b"  # nothing else left: still try


def test_spread_balances_by_expected_wait():
    a, b = Endpoint("http://a", latency=0.1), Endpoint("http://b", latency=0.1)
    picks = []
    for _ in range(10):
        e = pick_endpoint([a, b], spread=True, now=0)
        e.in_flight += 1
        picks.append(e.url)
    assert picks.count("http://a") == picks.count("http://b") == 5


def _body(rows: list[np.ndarray], b64: bool) -> bytes:
    data = [
        {"index": i, "embedding": base64.b64encode(r.astype("<f4").tobytes()).decode() if b64 else r.tolist()}
        for i, r in enumerate(rows)
    ]
    return orjson.dumps({"data": data[::-1], "usage": {"prompt_tokens": 3, "total_tokens": 3}})


@pytest.mark.parametrize("b64", [True, False])
def test_decode_orders_rows_by_index(b64: bool):
    rows = [np.arange(4, dtype=np.float32) + i for i in range(3)]
    out, usage = decode_embeddings(_body(rows, b64), 3)
    np.testing.assert_array_equal(out, np.stack(rows))
    assert usage.total_tokens == 3


@pytest.mark.parametrize(
    ("rows", "expected", "dims", "needle"),
    [
        ([np.ones(4)] * 2, 3, None, "2 vectors for 3 inputs"),
        ([np.ones(4), np.ones(3)], 2, None, "has dimension"),
        ([np.ones(4)] * 2, 2, 8, "asked for 8"),
    ],
)
def test_decode_rejects_misshapen_responses(rows, expected, dims, needle):
    with pytest.raises(ResponseMismatchError, match=needle):
        decode_embeddings(_body([np.asarray(r, np.float32) for r in rows], True), expected, dims)


def test_decode_rejects_repeated_index_and_bad_json():
    body = orjson.dumps({"data": [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [2.0]}]})
    with pytest.raises(ResponseMismatchError, match="repeated index"):
        decode_embeddings(body, 2)
    with pytest.raises(ResponseMismatchError, match="not valid JSON"):
        decode_embeddings(b'{"data": [', 2)


def test_batch_failed_error_names_inputs():
    err = BatchFailedError(
        [FailedBatch(10, 20, RuntimeError("boom")), FailedBatch(0, 1, RuntimeError("x"))], 50
    )
    assert err.failed_indices == [0, *range(10, 20)]
    assert "11 of 50 inputs failed" in str(err) and "inputs 10-19" in str(err) and "input 0:" in str(err)
