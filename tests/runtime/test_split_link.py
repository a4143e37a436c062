"""The frames between fronts and the engine (runtime split/link.py): what goes in comes out, and a frame
that does not add up is refused before it is trusted."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.core.jobs import DeadlineUnmet, EngineUnavailable, QueueFull, RequestTooLarge
from embedfleet.runtime.split import link
from embedfleet.runtime.split.front_side import _refusal
from embedfleet.runtime.tenants import RequestOverQuota

rows_of_ids = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), min_size=1, max_size=20)


def body_of(data: bytes) -> tuple[int, bytes]:
    kind, size = link.HEADER.unpack_from(data)
    assert size == len(data) - link.HEADER.size
    return kind, data[link.HEADER.size:]


@given(rows_of_ids, st.booleans())
def test_a_submit_reads_back_as_sent(ids, pairs):
    types = [[i % 2 for i in range(len(row))] for row in ids] if pairs else None
    lengths = [len(row) + 3 for row in ids]
    meta = {"model": "m", "urgent": True, "deadline": 12.5, "tenant": "t", "pairs": pairs}
    kind, body = body_of(link.submit(7, meta, ids, types, lengths))
    assert kind == link.SUBMIT
    got = link.read_submit(body)
    assert got.request_id == 7 and got.meta == meta
    assert got.ids == ids and all(type(i) is int for row in got.ids for i in row)
    assert got.original_lengths.tolist() == lengths
    assert got.type_ids == types


def test_colbert_inputs_keep_their_attended_counts_and_truncation():
    from embedfleet.runtime.core.multivector import Marked
    from embedfleet.runtime.split.engine_side import inputs_of

    sent = [Marked([1, 2, 3, 4], True, 2), Marked([5, 6], False, None)]
    lengths = [len(m) + int(m.truncated) for m in sent]
    attended = [-1 if m.attended is None else m.attended for m in sent]
    frame = link.submit(9, {"model": "m", "marked": True}, [m.ids for m in sent], None, lengths, attended)
    assert inputs_of(link.read_submit(body_of(frame)[1])) == sent
    with pytest.raises(link.WireError):  # counts without the flag, or the flag without counts
        link.submit(9, {"model": "m"}, [[1]], None, [1], [1])


def test_requests_and_answers_over_the_limits_are_refused_before_they_are_sent():
    with pytest.raises(link.TooLarge):
        link.check_size(link.LIMITS.max_inputs + 1, 10)
    with pytest.raises(link.TooLarge):
        link.check_size(1, link.LIMITS.max_tokens + 1)
    link.check_size(link.LIMITS.max_inputs, link.LIMITS.max_tokens)
    wide = np.zeros((1, link.LIMITS.max_reply_values + 1), dtype=np.float32)
    with pytest.raises(link.TooLarge):
        link.result(1, wide, 0.0, 0.0)
    assert len(link.result(1, wide[:, :-1], 0.0, 0.0)) <= link.HEADER.size + link.MAX_REPLY_FRAME


def test_results_and_ragged_rows_read_back_as_sent():
    rows = np.random.default_rng(0).standard_normal((5, 384)).astype(np.float32)
    request_id, got, queue_s, inference_s = link.read_result(*body_of(link.result(3, rows, 0.25, 0.5)))
    assert (request_id, queue_s, inference_s) == (3, 0.25, 0.5) and np.array_equal(got, rows)
    got[0, 0] = 1.0  # a writable copy: post-processing normalises in place
    ragged = [rows[:2], rows[2:3], rows[3:]]
    _, back, _, _ = link.read_result(*body_of(link.result(4, ragged, 0.0, 0.0)))
    assert [r.tolist() for r in back] == [r.tolist() for r in ragged]


def test_ragged_results_whose_lengths_do_not_partition_the_rows_are_refused():
    """What a front reads from the engine is checked like what the engine reads from a front: per-input
    counts that are negative (rows handed to two inputs) or more than the frame holds are a WireError."""
    rows = np.zeros((4, 8), dtype=np.float32)
    kind, body = body_of(link.result(5, [rows[:2], rows[2:]], 0.0, 0.0))
    broken = bytearray(body)
    struct.pack_into("<ii", broken, link.RAGGED_HEAD.size, 6, -2)  # adds up to 4, overlapping
    with pytest.raises(link.WireError):
        link.read_result(kind, bytes(broken))
    broken = bytearray(body)
    struct.pack_into("<I", broken, link.RAGGED_HEAD.size - 4, 10**6)  # more inputs than the frame holds
    with pytest.raises(link.WireError):
        link.read_result(kind, bytes(broken))


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_a_submit_that_does_not_add_up_is_refused(cut):
    _, body = body_of(link.submit(1, {"model": "m"}, [[1, 2, 3], [4]], None, [3, 1]))
    with pytest.raises(link.WireError):
        link.read_submit(body[:-cut])
    with pytest.raises(link.WireError):
        link.read_submit(body + b"\0" * 4)


def test_bad_metadata_and_offsets_are_refused():
    _, body = body_of(link.submit(1, {"model": "m"}, [[1, 2, 3]], None, [3]))
    meta_len = link.SUBMIT_HEAD.unpack_from(body)[1]
    broken = bytearray(body)
    broken[link.SUBMIT_HEAD.size] = ord("[")  # metadata no longer JSON
    with pytest.raises(link.WireError):
        link.read_submit(bytes(broken))
    offsets_at = link.SUBMIT_HEAD.size + meta_len + 16  # the wire request's header, then its offsets
    broken = bytearray(body)
    struct.pack_into("<i", broken, offsets_at + 4, 9)  # an offset past the ids
    with pytest.raises(link.WireError):
        link.read_submit(bytes(broken))
    with pytest.raises(link.WireError):
        link.submit(1, {"model": "m" * link.MAX_META}, [[1]], None, [1])


def test_a_frame_header_over_the_limit_or_of_no_kind_is_refused_before_its_body_is_read():
    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await link.read_frame(reader, link.MAX_REQUEST_FRAME)

    with pytest.raises(link.WireError):
        asyncio.run(read(link.HEADER.pack(link.SUBMIT, link.MAX_REQUEST_FRAME + 1)))
    with pytest.raises(link.WireError):
        asyncio.run(read(link.HEADER.pack(99, 0)))
    assert asyncio.run(read(link.frame(link.CANCEL, link.ID.pack(5)))) == (link.CANCEL, link.ID.pack(5))


def test_the_engines_refusals_come_back_as_the_same_exceptions():
    def back(frame: bytes) -> Exception:
        _, body = body_of(frame)
        return _refusal(link.read_json(body, link.ID.size))

    full = back(link.error(1, "queue_full", "over the bound", 3.5, "expected_wait"))
    assert isinstance(full, QueueFull) and full.retry_after == 3.5 and full.reason == "expected_wait"
    assert isinstance(back(link.error(1, "deadline", "late")), DeadlineUnmet)
    over = back(link.error(1, "over_quota", "too big"))
    assert isinstance(over, RequestOverQuota) and str(over) == "too big"
    assert isinstance(back(link.error(1, "unavailable", "gone")), EngineUnavailable)
    assert isinstance(back(link.error(1, "oom", "CUDA out of memory")), MemoryError)
    assert str(back(link.error(1, "internal", "ValueError: x"))) == "engine: ValueError: x"
    too_large = back(link.error(1, "too_large", "split it"))
    assert isinstance(too_large, RequestTooLarge) and str(too_large) == "split it"


@pytest.mark.parametrize("exc, status, code, retry_after", [
    (EngineUnavailable("the engine process is not running; retry shortly"), 503, "engine_unavailable", "1"),
    (link.TooLarge("5000 inputs of 5000 tokens in one request"), 413, "too_large", None),
])
def test_the_engines_conditions_are_answered_wherever_a_route_raises_them(exc, status, code, retry_after):
    """Any route (an embedding, the int8 calibration a front asks the engine for) that meets these gets the
    same answer: the split layer raises them, the API layer alone turns them into HTTP."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from embedfleet.runtime.api import errors

    counted: list[int] = []
    app = FastAPI()
    errors.install(app, counted.append)

    @app.get("/x")
    async def _raise() -> None:
        raise exc

    answer = TestClient(app).get("/x")
    assert answer.status_code == status and answer.json()["error"]["code"] == code, answer.text
    assert answer.json()["error"]["message"] == str(exc)
    assert answer.headers.get("retry-after") == retry_after
    assert counted == [status]
