"""The client against a real, deliberately misbehaving server process on loopback."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from embedfleet.client import (
    AsyncClient,
    BatchFailedError,
    Client,
    DeadlineExceeded,
    InputError,
    ResponseMismatchError,
    RetryPolicy,
    ServerError,
)

from .stub_server import FULL_DIM, score_for, vector_for

FAST = RetryPolicy(max_retries=3, initial_backoff=0.01, max_backoff=0.05)


def texts(n: int, prefix: str = "text") -> list[str]:
    return [f"{prefix} number {i} with a few words" for i in range(n)]


def expected(items: list[str], dim: int = FULL_DIM) -> np.ndarray:
    return np.stack([vector_for(t, dim) for t in items])


def posts(stub) -> list[dict]:
    return stub.stats()["log"]


@pytest.mark.parametrize("fmt", ["base64", "float"])
def test_rows_complete_and_in_input_order(stub, fmt):
    items = texts(50)
    with Client(stub.url, batch_size=7, max_concurrent_requests=4, retry=FAST) as c:
        result = c.embed_detailed(items, encoding_format=fmt)
    np.testing.assert_array_equal(result.embeddings, expected(items))
    assert result.embeddings.dtype == np.float32
    assert len(result.stats.batches) == 8 == stub.count
    assert sorted((b.start, b.stop) for b in result.stats.batches)[-1] == (49, 50)
    assert result.stats.usage.total_tokens == sum(len(t.split()) for t in items)
    assert all(b.seconds > 0 and b.attempts == 1 for b in result.stats.batches)


def test_dimensions_and_char_limit_split(stub):
    items = ["x" * 100] * 6
    with Client(stub.url, batch_size=100, max_chars_per_request=250) as c:
        out = c.embed(items, dimensions=4)
    assert out.shape == (6, 4)
    assert [r["n"] for r in posts(stub)] == [2, 2, 2]


def test_retries_500_then_succeeds(stub):
    stub.fault("status", times=2, status=500)
    items = texts(10)
    with Client(stub.url, batch_size=10, retry=FAST) as c:
        out = c.embed(items)
        assert c.stats.retries == 2
    np.testing.assert_array_equal(out, expected(items))
    assert stub.count == 3


def test_429_waits_for_retry_after(stub):
    stub.fault("status", times=1, status=429, retry_after=1)
    with Client(stub.url, batch_size=10, retry=FAST) as c:
        out = c.embed(texts(5))
    assert out.shape == (5, FULL_DIM)
    log = posts(stub)
    assert [r["fault"] for r in log] == ["status", None]
    assert log[1]["t"] - log[0]["t"] >= 0.95  # the server asked for a one-second pause


def test_dropped_connections_are_retried(stub):
    stub.fault("drop", times=2)
    items = texts(4)
    with Client(stub.url, retry=FAST) as c:
        out = c.embed(items)
        assert c.stats.retries == 2
    np.testing.assert_array_equal(out, expected(items))


def test_client_error_is_not_retried_and_names_inputs(stub):
    stub.fault("status", times=1, status=400, message="input too long")
    with Client(stub.url, batch_size=5, max_concurrent_requests=1, retry=FAST) as c:
        with pytest.raises(BatchFailedError) as info:
            c.embed(texts(10))
    assert info.value.failed_indices == [0, 1, 2, 3, 4]
    assert isinstance(info.value.failures[0].error, ServerError)
    assert "input too long" in str(info.value) and "inputs 0-4" in str(info.value)
    assert stub.count == 2


def test_exhausted_retries_fail_every_batch_never_fewer_rows(stub):
    stub.fault("status", times=-1, status=503)
    with Client(stub.url, batch_size=4, retry=RetryPolicy(max_retries=2, initial_backoff=0.01)) as c:
        with pytest.raises(BatchFailedError) as info:
            c.embed(texts(8))
    assert info.value.failed_indices == list(range(8))
    assert stub.count == 2 * 3


@pytest.mark.parametrize(
    ("kind", "needle"), [("wrong_count", "9 vectors for 10"), ("wrong_dim", "dimension")]
)
def test_wrong_shape_from_server_raises(stub, kind, needle):
    stub.fault(kind, times=1)
    with Client(stub.url, batch_size=10, max_concurrent_requests=1, retry=FAST) as c:
        with pytest.raises(BatchFailedError) as info:
            c.embed(texts(20))
    failure = info.value.failures[0]
    assert (failure.start, failure.stop) == (0, 10)
    assert isinstance(failure.error, ResponseMismatchError)
    assert needle in str(info.value)


def test_deadline_on_slow_server(stub):
    stub.fault("slow", times=-1, delay=5)
    with Client(stub.url, retry=FAST) as c:
        with pytest.raises(DeadlineExceeded) as info:
            c.embed(texts(3), deadline=0.3)
    assert isinstance(info.value, TimeoutError)
    assert info.value.failed_indices == [0, 1, 2]


def test_deadline_beats_long_retry_after(stub):
    stub.fault("status", times=-1, status=429, retry_after=30)
    with Client(stub.url, retry=FAST, deadline=0.5) as c:
        with pytest.raises(DeadlineExceeded):
            c.embed(texts(3))
    assert stub.count == 1


def test_hedge_rescues_a_stuck_request(stub):
    stub.fault("slow", times=1, delay=3)
    items = texts(20)
    with Client(stub.url, batch_size=2, max_concurrent_requests=10, hedge_delay=0.2, retry=FAST) as c:
        out = c.embed(items)
        assert c.stats.hedges == 1
    np.testing.assert_array_equal(out, expected(items))
    assert stub.count == 11


def test_hedges_stay_within_budget_when_everything_is_slow(stub):
    stub.fault("slow", times=-1, delay=0.3)
    with Client(stub.url, batch_size=1, max_concurrent_requests=20, hedge_delay=0.05, hedge_budget=0.1) as c:
        out = c.embed(texts(20))
        hedges = c.stats.hedges
    assert out.shape == (20, FULL_DIM)
    assert 1 <= hedges <= 2
    assert stub.count == 20 + hedges


def test_no_hedging_unless_asked(stub):
    stub.fault("slow", times=1, delay=0.3)
    with Client(stub.url, batch_size=2, max_concurrent_requests=10) as c:
        c.embed(texts(20))
        assert c.stats.hedges == 0
    assert stub.count == 10


def test_failover_from_dead_endpoint(stub, dead_url):
    items = texts(12)
    with Client([dead_url, stub.url], batch_size=4, retry=FAST) as c:
        out = c.embed(items)
        assert c.check_health() == {dead_url: False, stub.url: True}
    np.testing.assert_array_equal(out, expected(items))
    assert stub.count == 3


def test_failover_from_failing_endpoint(stub, stub2):
    stub2.control(health_delay=0.2)  # the first endpoint looks faster, so it is tried first
    stub.fault("status", times=-1, status=500)
    items = texts(12)
    with Client([stub.url, stub2.url], batch_size=4, max_concurrent_requests=1, retry=FAST) as c:
        out = c.embed(items)
    np.testing.assert_array_equal(out, expected(items))
    assert stub2.count == 3
    assert stub.count >= 1


def test_prefers_lowest_latency_healthy_endpoint(stub, stub2):
    stub.control(health_delay=0.3)
    with Client([stub.url, stub2.url], batch_size=2, max_concurrent_requests=2) as c:
        c.embed(texts(10))
    assert stub.count == 0 and stub2.count == 5


def test_unhealthy_endpoint_is_avoided(stub, stub2):
    stub2.control(health_status=503)
    with Client([stub2.url, stub.url], batch_size=2) as c:
        c.embed(texts(10))
    assert stub2.count == 0 and stub.count == 5


def test_spread_uses_every_endpoint(stub, stub2):
    stub.fault("slow", times=-1, delay=0.05)
    stub2.fault("slow", times=-1, delay=0.05)
    items = texts(40)
    with Client([stub.url, stub2.url], batch_size=2, max_concurrent_requests=8, spread=True) as c:
        out = c.embed(items)
    np.testing.assert_array_equal(out, expected(items))
    assert stub.count > 0 and stub2.count > 0 and stub.count + stub2.count == 20


def test_rerank_across_batches(stub):
    docs = ["cats purr", "dogs bark loudly", "cats and dogs", "weather report", "cats cats cats"]
    with Client(stub.url, batch_size=2) as c:
        hits = c.rerank("cats", docs, return_text=True)
    assert sorted(h.index for h in hits) == list(range(5))
    assert [h.score for h in hits] == sorted((score_for("cats", d) for d in docs), reverse=True)
    assert all(h.text == docs[h.index] for h in hits)
    assert hits[0].index == 4
    assert stub.count == 3


@pytest.mark.parametrize("route", ["classify", "predict"])
def test_classify_in_order_on_either_route(stub, route):
    stub.control(classify_route=route)
    items = texts(5)
    with Client(stub.url, batch_size=2) as c:
        rows = c.classify(items)
    assert len(rows) == 5
    assert all({lab.label for lab in row} == {"positive", "negative"} for row in rows)
    assert all(row[0].score >= row[1].score for row in rows)
    assert {r["route"] for r in posts(stub)} == {route}


def test_async_client_concurrent_calls(stub):
    async def main() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncClient(stub.url, batch_size=3) as c:
            return await asyncio.gather(c.embed(texts(7, "a")), c.embed(texts(5, "b")))

    a, b = asyncio.run(main())
    np.testing.assert_array_equal(a, expected(texts(7, "a")))
    np.testing.assert_array_equal(b, expected(texts(5, "b")))


def test_bad_input_is_refused_before_sending(stub):
    with Client(stub.url) as c:
        with pytest.raises(InputError, match="input 2 is an empty string"):
            c.embed(["a", "b", "", "d"])
        with pytest.raises(InputError, match="not str"):
            c.embed(["a", None])  # type: ignore[list-item]
        assert c.embed([]).shape[0] == 0
    assert stub.count == 0


def test_async_client_survives_a_new_event_loop(stub):
    client = AsyncClient(stub.url)
    first = asyncio.run(client.embed(texts(3)))
    second = asyncio.run(client.embed(texts(3)))
    asyncio.run(client.close())
    np.testing.assert_array_equal(first, second)
    assert client.stats.requests == 2
