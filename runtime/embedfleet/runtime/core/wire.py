"""The framing between a front process and an engine process: token ids one way, vectors back.

A request is a fixed header (request id, inputs, tokens) followed by ``inputs + 1`` int32 offsets and
``tokens`` int32 ids; a reply is a header (request id, rows, dimension, status) followed by ``rows x
dimension`` float32 values, or, where status is not 0, a UTF-8 message of ``dimension`` bytes. Everything
is little-endian and fixed-size, so a reader knows how much follows from the header alone and reads it in
one call; no per-input Python object crosses the boundary (bench/ipc.py measured this against pyzmq with
msgspec and against the in-process hand-off).

The reader is the bound: a header whose sizes exceed the limits it was given is refused before anything is
allocated, and a body whose offsets are not a valid partition of its ids is refused after it is read, so a
broken or hostile peer costs at most one frame of the limits' size.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass

import numpy as np

REQUEST = struct.Struct("<QII")  # request id, inputs, tokens
REPLY = struct.Struct("<QIIi")  # request id, rows, dimension (or message bytes), status (0: vectors follow)


class WireError(ValueError):
    """A frame that breaks the format or the reader's limits (the connection is not to be trusted after it)."""


@dataclass(frozen=True)
class Limits:
    """The most one frame may carry; a reader refuses a header over them before allocating its body."""
    max_inputs: int = 4096
    max_tokens: int = 4 * 1024 * 1024
    max_reply_values: int = 64 * 1024 * 1024
    max_message: int = 64 * 1024


def encode_request(request_id: int, batch: list[list[int]]) -> tuple[bytes, bytes, bytes]:
    """The header, offsets and ids of `batch` (token id lists), as three buffers for one vectored write."""
    lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
    offsets = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if total >= 2**31:
        raise WireError(f"{total} tokens in one request: over what int32 offsets address")
    ids = np.fromiter(itertools.chain.from_iterable(batch), dtype=np.int32, count=total)
    return REQUEST.pack(request_id, len(batch), total), offsets.astype(np.int32).tobytes(), ids.tobytes()


def request_body_size(header: bytes, limits: Limits) -> tuple[int, int, int, int]:
    """(request id, inputs, tokens, bytes of body that follow) from a request header, within `limits`."""
    request_id, inputs, tokens = REQUEST.unpack(header)
    if not 1 <= inputs <= limits.max_inputs:
        raise WireError(f"a request of {inputs} inputs (1 to {limits.max_inputs} allowed)")
    if tokens > limits.max_tokens:
        raise WireError(f"a request of {tokens} tokens (at most {limits.max_tokens})")
    return request_id, inputs, tokens, 4 * (inputs + 1 + tokens)


def decode_request_body(body: bytes | bytearray | memoryview, inputs: int, tokens: int) -> list[list[int]]:
    """The id rows of a request body, as the lists the batch manager and the engines take; WireError unless
    the offsets start at 0, never decrease, end at `tokens`, and leave no row empty.

    One `tolist` of all the ids and a slice per row: the engine process' event loop does this for every
    input it serves, and an array per row (`np.split`, then a `tolist` each) cost it several times more."""
    if len(body) != 4 * (inputs + 1 + tokens):
        raise WireError(f"a body of {len(body)} bytes for {inputs} inputs of {tokens} tokens")
    offsets = np.frombuffer(body, dtype=np.int32, count=inputs + 1)
    # steps in int64: in int32 a step from 2**31 - 1 down to -2**31 wraps round to 1 and passes, and Python's
    # slicing then clamps such bounds into rows that repeat all the ids (a frame's worth, many times over)
    if offsets[0] != 0 or offsets[-1] != tokens or (np.diff(offsets.astype(np.int64)) < 1).any():
        raise WireError("offsets are not a partition of the ids into non-empty rows")
    return split_rows(np.frombuffer(body, dtype=np.int32, offset=4 * (inputs + 1), count=tokens), offsets)


def split_rows(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    """`flat` cut at `offsets` (a validated partition: first 0, last len(flat)) into lists of ints."""
    values, bounds = flat.tolist(), offsets.tolist()
    return [values[a:b] for a, b in itertools.pairwise(bounds)]


def encode_reply(request_id: int, vectors: np.ndarray) -> tuple[bytes, bytes]:
    """The header and float32 body of a reply carrying `vectors` (rows x dimension)."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise WireError(f"vectors of {vectors.ndim} dimensions (2 expected)")
    rows, dim = vectors.shape
    return REPLY.pack(request_id, rows, dim, 0), vectors.tobytes()


def encode_error(request_id: int, status: int, message: str) -> tuple[bytes, bytes]:
    """A reply that carries no vectors: `status` (not 0: the front maps it to an HTTP status) and why."""
    if status == 0:
        raise WireError("status 0 means vectors follow")
    text = message.encode("utf-8", "replace")[:Limits.max_message]
    return REPLY.pack(request_id, 0, len(text), status), text


def reply_body_size(header: bytes, limits: Limits) -> tuple[int, int, int, int, int]:
    """(request id, rows, dimension, status, bytes of body that follow) from a reply header, within `limits`."""
    request_id, rows, dim, status = REPLY.unpack(header)
    if status:
        if rows or dim > limits.max_message:
            raise WireError(f"an error reply of {rows} rows and {dim} message bytes")
        return request_id, 0, dim, status, dim
    if rows * dim > limits.max_reply_values:
        raise WireError(f"a reply of {rows} x {dim} values (at most {limits.max_reply_values})")
    return request_id, rows, dim, status, 4 * rows * dim


def decode_reply_body(body: bytes | bytearray | memoryview, rows: int, dim: int, status: int) -> np.ndarray | str:
    """The vectors of a reply (a view into `body`), or its error message where status is not 0."""
    if status:
        return bytes(body).decode("utf-8", "replace")
    if len(body) != 4 * rows * dim:
        raise WireError(f"a reply body of {len(body)} bytes for {rows} x {dim} values")
    return np.frombuffer(body, dtype=np.float32).reshape(rows, dim)
