"""The front-to-engine framing (embedfleet/runtime/core/wire.py): what goes in comes out, over a real socket
pair too, and a peer that lies in a header or a body is refused before anything of the lied size is
allocated."""

from __future__ import annotations

import socket
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.core import wire

ROWS = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), min_size=1, max_size=30)


def body_of(parts: tuple[bytes, bytes, bytes]) -> bytes:
    return parts[1] + parts[2]


@given(request_id=st.integers(0, 2**64 - 1), batch=ROWS)
def test_a_request_round_trips(request_id: int, batch: list[list[int]]) -> None:
    parts = wire.encode_request(request_id, batch)
    got_id, inputs, tokens, size = wire.request_body_size(parts[0], wire.Limits())
    assert (got_id, inputs, tokens) == (request_id, len(batch), sum(map(len, batch)))
    assert size == len(body_of(parts))
    rows = wire.decode_request_body(body_of(parts), inputs, tokens)
    assert rows == batch and all(type(i) is int for row in rows for i in row)


@given(request_id=st.integers(0, 2**64 - 1), rows=st.integers(1, 20), dim=st.integers(1, 64), seed=st.integers(0, 9))
def test_a_reply_round_trips_bit_for_bit(request_id: int, rows: int, dim: int, seed: int) -> None:
    vectors = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    head, body = wire.encode_reply(request_id, vectors)
    got_id, got_rows, got_dim, status, size = wire.reply_body_size(head, wire.Limits())
    assert (got_id, got_rows, got_dim, status, size) == (request_id, rows, dim, 0, len(body))
    out = wire.decode_reply_body(body, got_rows, got_dim, status)
    assert isinstance(out, np.ndarray) and out.tobytes() == vectors.tobytes()


def test_an_error_reply_carries_its_status_and_message() -> None:
    head, body = wire.encode_error(7, 429, "the queue is full: retry in 2s")
    request_id, rows, dim, status, size = wire.reply_body_size(head, wire.Limits())
    assert (request_id, rows, status) == (7, 0, 429) and size == len(body)
    assert wire.decode_reply_body(body, rows, dim, status) == "the queue is full: retry in 2s"
    with pytest.raises(wire.WireError):
        wire.encode_error(7, 0, "status 0 is for vectors")


def test_headers_over_the_limits_are_refused_before_any_allocation() -> None:
    """A header is 16 or 20 bytes; what it declares could be gigabytes. The reader refuses it from the
    header alone: nothing near the declared size is allocated."""
    limits = wire.Limits(max_inputs=8, max_tokens=1000, max_reply_values=10_000, max_message=100)
    tracemalloc.start()
    try:
        for header, why in [(wire.REQUEST.pack(1, 2**32 - 1, 5), "inputs"),
                            (wire.REQUEST.pack(1, 0, 5), "0 inputs"),
                            (wire.REQUEST.pack(1, 4, 2**32 - 1), "tokens")]:
            with pytest.raises(wire.WireError, match=why):
                wire.request_body_size(header, limits)
        for header in (wire.REPLY.pack(1, 2**20, 2**20, 0), wire.REPLY.pack(1, 0, 2**31 - 1, 500),
                       wire.REPLY.pack(1, 3, 10, 500)):
            with pytest.raises(wire.WireError):
                wire.reply_body_size(header, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000, f"{peak} bytes allocated while refusing headers"


@pytest.mark.parametrize("offsets", [[1, 2, 3], [0, 2, 2], [0, 3, 2], [0, 1, 4], [0, -1, 3]])
def test_offsets_that_do_not_partition_the_ids_are_refused(offsets: list[int]) -> None:
    body = np.array(offsets, dtype=np.int32).tobytes() + np.arange(3, dtype=np.int32).tobytes()
    with pytest.raises(wire.WireError, match="partition"):
        wire.decode_request_body(body, 2, 3)


def test_offsets_whose_int32_steps_wrap_round_are_refused() -> None:
    """2**31 - 1 then -2**31 is a step of 1 in int32 arithmetic: such offsets would pass a check made in
    int32, and slicing would then hand out rows that each repeat all the ids (a frame's memory many times
    over, from one small frame)."""
    tokens = 1000
    offsets = [0, 2**30, 2**31 - 1, -2**31, -2**30, 0, tokens]
    body = np.array(offsets, dtype=np.int32).tobytes() + np.arange(tokens, dtype=np.int32).tobytes()
    with pytest.raises(wire.WireError, match="partition"):
        wire.decode_request_body(body, len(offsets) - 1, tokens)


def test_a_body_of_the_wrong_length_is_refused() -> None:
    _head, offsets, ids = wire.encode_request(1, [[1, 2], [3]])
    with pytest.raises(wire.WireError, match="bytes"):
        wire.decode_request_body((offsets + ids)[:-4], 2, 3)
    with pytest.raises(wire.WireError, match="bytes"):
        wire.decode_reply_body(b"\0" * 12, 2, 2, 0)
    with pytest.raises(wire.WireError, match="dimensions"):
        wire.encode_reply(1, np.zeros(3, dtype=np.float32))


def test_frames_cross_a_real_socket_pair_in_order() -> None:
    """Many requests written back to back in vectored writes, read by header then body, as the two
    processes do."""
    a, b = socket.socketpair()
    with a, b:
        batches = [[[i, i + 1, i + 2]] * (1 + i % 5) for i in range(200)]
        for i, batch in enumerate(batches):
            a.sendmsg(wire.encode_request(i, batch))
        a.shutdown(socket.SHUT_WR)
        stream = b.makefile("rb")
        for i, batch in enumerate(batches):
            request_id, inputs, tokens, size = wire.request_body_size(stream.read(wire.REQUEST.size), wire.Limits())
            rows = wire.decode_request_body(stream.read(size), inputs, tokens)
            assert request_id == i and rows == batch
        assert stream.read() == b""


def test_a_request_too_large_for_int32_offsets_is_refused_when_encoding() -> None:
    class Huge(list):
        def __len__(self) -> int:
            return 2**31

    with pytest.raises(wire.WireError, match="int32"):
        wire.encode_request(1, [Huge()])
    assert struct.calcsize("<QII") == wire.REQUEST.size
