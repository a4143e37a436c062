"""The frames between a front process and the engine process, over one Unix stream socket per front.

Every frame is a 5-byte header (kind, body length) and a body. Token ids and vectors travel as arrays in
core/wire.py's layout (a request's offsets and int32 ids; a reply's float32 rows), never as per-input Python
objects; the little a request needs besides (model, urgency, deadline, tenant) is a short JSON block.

    front -> engine   SUBMIT   id, metadata, ids (wire request), [type ids], original lengths
                      CANCEL   id: the client left; whatever of it is still queued is dropped
                      CALL     id, JSON: a small question (the int8 calibration)
    engine -> front   RESULT   id, queue and inference seconds, vectors (wire reply)
                      RAGGED   id, seconds, per-input row counts, the rows stacked (per-token outputs)
                      ERROR    id, JSON: the exception's kind, message, retry-after and reason
                      STATE    JSON: loaded or not, and per model the load figures fronts refuse early on
                      ANSWER   id, JSON length, JSON, then bytes

The reader is the bound: a header announcing more than its end's limit (MAX_REQUEST_FRAME, MAX_REPLY_FRAME), or
a body whose parts do not add up, raises WireError before anything is trusted; the connection is then closed.
So that no tenant's request can do that, the front refuses (413) a request over LIMITS before sending it, and
the engine answers an answer over LIMITS with an ERROR for that request alone (`TooLarge`). Both ends run as the
same user on one machine (the engine checks the peer's uid), so the bounds guard against bugs, not tenants.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from dataclasses import dataclass

import numpy as np
import orjson

from embedfleet.runtime.core import wire
from embedfleet.runtime.core.jobs import RequestTooLarge
from embedfleet.runtime.core.wire import WireError

HEADER = struct.Struct("<BI")  # kind, body bytes
SUBMIT, CANCEL, CALL, RESULT, RAGGED, ERROR, STATE, ANSWER = range(1, 9)
ID = struct.Struct("<Q")
SUBMIT_HEAD = struct.Struct("<QH")  # id, metadata bytes
RESULT_HEAD = struct.Struct("<Qdd")  # id, queue seconds, inference seconds
RAGGED_HEAD = struct.Struct("<QddI")  # ... and the number of inputs
ANSWER_HEAD = struct.Struct("<QI")  # id, JSON bytes
LIMITS = wire.Limits()
MAX_META = 4096
# the largest frame each end reads: a request of LIMITS (offsets, ids, type ids, lengths, ColBERT's attended
# counts), and a reply of LIMITS.max_reply_values (sparse models answer vocabulary-wide rows)
MAX_REQUEST_FRAME = 4 * (3 * LIMITS.max_inputs + 2 + 2 * LIMITS.max_tokens) + MAX_META + 64
MAX_REPLY_FRAME = 4 * (LIMITS.max_reply_values + LIMITS.max_inputs) + LIMITS.max_message + 64


TooLarge = RequestTooLarge  # over what one frame may carry (LIMITS): refused (413) before it is sent


@dataclass(frozen=True)
class Submitted:
    """A SUBMIT frame, read: the metadata, the inputs' ids (and segments) as lists, and per-input int32 arrays
    (views into the frame)."""
    request_id: int
    meta: dict
    ids: list[list[int]]
    type_ids: list[list[int]] | None
    original_lengths: np.ndarray
    attended: np.ndarray | None = None  # ColBERT inputs (meta "marked"): attended tokens, -1 for all


def frame(kind: int, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return HEADER.pack(kind, len(body)) + body


def check_size(inputs: int, tokens: int) -> None:
    """TooLarge unless a request of `inputs` inputs and `tokens` tokens fits one frame."""
    if inputs > LIMITS.max_inputs or tokens > LIMITS.max_tokens:
        raise TooLarge(f"{inputs} inputs of {tokens} tokens in one request: the server takes at most "
                       f"{LIMITS.max_inputs} inputs and {LIMITS.max_tokens} tokens per request; split it")


def submit(request_id: int, meta: dict, ids: list[list[int]], type_ids: list[list[int]] | None,
           original_lengths: list[int], attended: list[int] | None = None) -> bytes:
    """The SUBMIT frame of one request; `meta` must be small (model, urgent, bounded, deadline, tenant, ...).
    With `attended` (ColBERT inputs), meta must say "marked"."""
    meta_bytes = orjson.dumps(meta)
    if len(meta_bytes) > MAX_META:
        raise WireError(f"request metadata of {len(meta_bytes)} bytes (at most {MAX_META})")
    if bool(meta.get("marked")) != (attended is not None):
        raise WireError("attended counts go with marked inputs, and only with them")
    head, offsets, flat = wire.encode_request(request_id, ids)
    parts = [SUBMIT_HEAD.pack(request_id, len(meta_bytes)), meta_bytes, head, offsets, flat]
    if type_ids is not None:
        total = len(flat) // 4
        types = np.fromiter(itertools.chain.from_iterable(type_ids), dtype=np.int32, count=total)
        parts.append(types.tobytes())
    parts.append(np.asarray(original_lengths, dtype=np.int32).tobytes())
    if attended is not None:
        parts.append(np.asarray(attended, dtype=np.int32).tobytes())
    return frame(SUBMIT, *parts)


def read_submit(body: bytes) -> Submitted:
    """The parts of a SUBMIT body; WireError when they do not add up."""
    view = memoryview(body)
    if len(view) < SUBMIT_HEAD.size + wire.REQUEST.size:
        raise WireError("a SUBMIT frame shorter than its headers")
    request_id, meta_len = SUBMIT_HEAD.unpack_from(view)
    at = SUBMIT_HEAD.size
    if meta_len > MAX_META or at + meta_len + wire.REQUEST.size > len(view):
        raise WireError(f"request metadata of {meta_len} bytes")
    try:
        meta = orjson.loads(view[at:at + meta_len])
    except orjson.JSONDecodeError as exc:
        raise WireError(f"request metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError("request metadata is not an object")
    at += meta_len
    _, inputs, tokens, size = wire.request_body_size(bytes(view[at:at + wire.REQUEST.size]), LIMITS)
    at += wire.REQUEST.size
    pairs, marked = bool(meta.get("pairs")), bool(meta.get("marked"))
    rest = size + (4 * tokens if pairs else 0) + 4 * inputs + (4 * inputs if marked else 0)
    if at + rest != len(view):
        raise WireError(f"a SUBMIT body of {len(view)} bytes for {inputs} inputs of {tokens} tokens")
    ids = wire.decode_request_body(view[at:at + size], inputs, tokens)
    at += size
    type_ids = None
    if pairs:
        flat = np.frombuffer(view, dtype=np.int32, offset=at, count=tokens)
        type_ids = wire.split_rows(flat, np.frombuffer(view, dtype=np.int32, offset=at - size, count=inputs + 1))
        at += 4 * tokens
    original = np.frombuffer(view, dtype=np.int32, offset=at, count=inputs)
    attended = np.frombuffer(view, dtype=np.int32, offset=at + 4 * inputs, count=inputs) if marked else None
    return Submitted(request_id, meta, ids, type_ids, original, attended)


def result(request_id: int, rows: np.ndarray | list[np.ndarray], queue_s: float, inference_s: float) -> bytes:
    """RESULT (one 2-D array) or RAGGED (a list of per-input arrays, stacked) for `rows`; TooLarge over
    LIMITS.max_reply_values."""
    values = sum(r.size for r in rows) if isinstance(rows, list) else rows.size
    if values > LIMITS.max_reply_values:
        raise TooLarge(f"an answer of {values} values: more than the {LIMITS.max_reply_values} one response "
                       "may carry; send fewer inputs per request")
    if isinstance(rows, list):
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        stacked = np.vstack(rows) if rows else np.zeros((0, 0), dtype=np.float32)
        head, values = wire.encode_reply(request_id, stacked)
        return frame(RAGGED, RAGGED_HEAD.pack(request_id, queue_s, inference_s, len(rows)), lengths.tobytes(),
                     head, values)
    head, values = wire.encode_reply(request_id, rows.reshape(len(rows), -1))
    return frame(RESULT, RESULT_HEAD.pack(request_id, queue_s, inference_s), head, values)


def read_result(kind: int, body: bytes) -> tuple[int, np.ndarray | list[np.ndarray], float, float]:
    """(id, rows, queue seconds, inference seconds) of a RESULT or RAGGED body; the rows are a writable copy."""
    view = memoryview(body)
    if kind == RAGGED:
        request_id, queue_s, inference_s, count = RAGGED_HEAD.unpack_from(view)
        at = RAGGED_HEAD.size
        if at + 4 * count + wire.REPLY.size > len(view):
            raise WireError(f"a ragged result of {count} inputs in a body of {len(view)} bytes")
        lengths = np.frombuffer(view, dtype=np.int32, offset=at, count=count)
        at += 4 * count
    else:
        request_id, queue_s, inference_s = RESULT_HEAD.unpack_from(view)
        at, lengths = RESULT_HEAD.size, None
    _, rows, dim, status, size = wire.reply_body_size(bytes(view[at:at + wire.REPLY.size]), LIMITS)
    at += wire.REPLY.size
    if status or at + size != len(view):
        raise WireError(f"a result body of {len(view)} bytes for {rows} x {dim} values")
    values = np.frombuffer(view, dtype=np.float32, offset=at, count=rows * dim).reshape(rows, dim).copy()
    if lengths is None:
        return request_id, values, queue_s, inference_s
    if (lengths < 0).any() or int(lengths.sum(dtype=np.int64)) != rows:  # a negative one would overlap rows
        raise WireError(f"ragged lengths {lengths.tolist()[:8]}... that are not a partition of {rows} rows")
    return request_id, np.split(values, np.cumsum(lengths)[:-1]), queue_s, inference_s


def error(request_id: int, kind: str, message: str, retry_after: float = 0.0, reason: str = "") -> bytes:
    payload = orjson.dumps({"kind": kind, "message": message[:LIMITS.max_message], "retry_after": retry_after,
                            "reason": reason})
    return frame(ERROR, ID.pack(request_id), payload)


def read_json(body: bytes, at: int = 0) -> dict:
    try:
        value = orjson.loads(memoryview(body)[at:])
    except orjson.JSONDecodeError as exc:
        raise WireError(f"a frame's JSON is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise WireError("a frame's JSON is not an object")
    return value


def answer(request_id: int, payload: dict, data: bytes = b"") -> bytes:
    text = orjson.dumps(payload)
    return frame(ANSWER, ANSWER_HEAD.pack(request_id, len(text)), text, data)


def read_answer(body: bytes) -> tuple[int, dict, bytes]:
    request_id, size = ANSWER_HEAD.unpack_from(body)
    at = ANSWER_HEAD.size
    if at + size > len(body):
        raise WireError("an ANSWER frame shorter than its JSON")
    try:
        payload = orjson.loads(memoryview(body)[at:at + size])
    except orjson.JSONDecodeError as exc:
        raise WireError(f"an ANSWER's JSON is not JSON: {exc}") from None
    return request_id, payload, bytes(memoryview(body)[at + size:])


async def read_frame(reader: asyncio.StreamReader, max_size: int) -> tuple[int, bytes]:
    """The next (kind, body); IncompleteReadError at the end of the stream, WireError on a bad header or
    one announcing more than `max_size` bytes (MAX_REQUEST_FRAME at the engine, MAX_REPLY_FRAME at a front)."""
    kind, size = HEADER.unpack(await reader.readexactly(HEADER.size))
    if not SUBMIT <= kind <= ANSWER:
        raise WireError(f"a frame of unknown kind {kind}")
    if size > max_size:
        raise WireError(f"a frame of {size} bytes (at most {max_size})")
    return kind, await reader.readexactly(size)
