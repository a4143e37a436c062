"""Response bodies -> numpy, checked.

The speed of a Python embedding client is decided here: base64 rows go from the JSON string to a
float32 view with one `b64decode` and one `np.frombuffer` each, with no Python float objects. Every
check (row count, indices, dimension) raises `ResponseMismatchError`, so a misbehaving server can
never make the caller write a short or ragged array.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

try:  # SIMD base64 (tens of times faster than binascii in its validating mode); optional
    import pybase64

    def _b64(text: str) -> bytes:
        return pybase64.b64decode(text, validate=True)
except ImportError:  # pragma: no cover - exercised only where pybase64 is absent

    def _b64(text: str) -> bytes:
        return binascii.a2b_base64(text)


from .errors import ResponseMismatchError

_F32 = np.dtype("<f4")


@dataclass
class Usage:
    """Token counts as the server reported them, summed over requests."""

    prompt_tokens: int = 0
    total_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.total_tokens += other.total_tokens


def load_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        snippet = body[:80].decode("utf-8", "replace")
        raise ResponseMismatchError(f"response is not valid JSON ({exc}): {snippet!r}") from None


def _usage(doc: dict[str, Any]) -> Usage:
    u = doc.get("usage") or {}
    try:
        return Usage(int(u.get("prompt_tokens") or 0), int(u.get("total_tokens") or 0))
    except (TypeError, ValueError, AttributeError):
        return Usage()


def decode_embeddings(body: bytes, expected: int, dimensions: int | None = None) -> tuple[np.ndarray, Usage]:
    """Parse an OpenAI embeddings response into a `(expected, dim)` float32 array in index order.

    The array may be a read-only view of the decoded bytes: copy it before writing to it.
    """
    doc = load_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ResponseMismatchError("response has no 'data' list")
    data = doc["data"]
    if len(data) != expected:
        raise ResponseMismatchError(f"server returned {len(data)} vectors for {expected} inputs")
    if expected == 0:
        return np.empty((0, dimensions or 0), dtype=np.float32), _usage(doc)
    out = _decode_fast(data, expected)
    if out is None:
        out = _decode_checked(data, expected)
    if out.shape[1] == 0:
        raise ResponseMismatchError("server returned an empty vector")
    if dimensions is not None and out.shape[1] != dimensions:
        raise ResponseMismatchError(f"server returned dimension {out.shape[1]}, asked for {dimensions}")
    return out, _usage(doc)


def _decode_fast(data: list[Any], n: int) -> np.ndarray | None:
    """The common, well-formed case in a few vectorised steps; None means "take the checked path".

    Rows of equal byte length encode to base64 strings of equal length; when those carry no padding,
    their concatenation is itself valid base64, so one `a2b_base64` decodes the whole batch.
    """
    try:
        embs = [item["embedding"] for item in data]
        idx = [item.get("index") for item in data]
    except (TypeError, KeyError, AttributeError):
        return None
    if idx == list(range(n)) or all(i is None for i in idx):
        order = None
    else:
        try:
            order = np.asarray(idx, dtype=np.int64)
        except (TypeError, ValueError):
            return None
        if order.ndim != 1 or not np.array_equal(np.sort(order), np.arange(n)):
            return None
    first = embs[0]
    if isinstance(first, str):
        width = len(first)
        if not all(type(e) is str and len(e) == width for e in embs):
            return None
        try:
            if width % 4 == 0 and not first.endswith("="):
                raw = _b64("".join(embs))
            else:
                raw = b"".join(_b64(e) for e in embs)
        except (binascii.Error, ValueError):
            return None
        if len(raw) % (4 * n):
            return None
        rows = np.frombuffer(raw, dtype=_F32).reshape(n, -1)
    elif isinstance(first, list):
        try:
            rows = np.array(embs, dtype=np.float32)
        except (TypeError, ValueError):
            return None
        if rows.ndim != 2:
            return None
    else:
        return None
    if order is None:
        return rows  # may be a read-only view of `raw`; callers copy it into their own array
    out = np.empty(rows.shape, dtype=np.float32)
    out[order] = rows
    return out


def _decode_checked(data: list[Any], expected: int) -> np.ndarray:
    """Row by row, raising `ResponseMismatchError` that names the first malformed row."""
    out: np.ndarray | None = None
    seen = np.zeros(expected, dtype=bool)
    for pos, item in enumerate(data):
        try:
            index = item.get("index", pos)
            emb = item["embedding"]
        except (AttributeError, KeyError, TypeError):
            raise ResponseMismatchError(f"data[{pos}] has no 'embedding'") from None
        if index is None:
            index = pos
        if not isinstance(index, int) or not 0 <= index < expected or seen[index]:
            raise ResponseMismatchError(f"data[{pos}] has a bad or repeated index {index!r}")
        seen[index] = True
        if isinstance(emb, str):
            try:
                raw = base64.b64decode(emb, validate=True)
            except (binascii.Error, ValueError):
                raise ResponseMismatchError(f"data[{pos}] is not valid base64") from None
            if len(raw) % 4:
                raise ResponseMismatchError(f"data[{pos}] base64 length {len(raw)} is not whole float32s")
            row = np.frombuffer(raw, dtype=_F32)
        elif isinstance(emb, list):
            try:
                row = np.asarray(emb, dtype=np.float32)
            except (TypeError, ValueError):
                raise ResponseMismatchError(f"data[{pos}] is not a list of numbers") from None
            if row.ndim != 1:
                raise ResponseMismatchError(f"data[{pos}] is not a flat vector")
        else:
            raise ResponseMismatchError(f"data[{pos}] embedding has type {type(emb).__name__}")
        if out is None:
            out = np.empty((expected, row.shape[0]), dtype=np.float32)
        elif row.shape[0] != out.shape[1]:
            raise ResponseMismatchError(
                f"data[{pos}] has dimension {row.shape[0]}, earlier rows have {out.shape[1]}"
            )
        out[index] = row
    assert out is not None
    return out


def error_details(body: bytes) -> tuple[str, str | None, str | int | None]:
    """(message, type, code) from an error body in our/OpenAI shape, or the raw text if not JSON."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200].decode("utf-8", "replace").strip() or "(empty body)", None, None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", "")), err.get("type"), err.get("code")
    if isinstance(err, str):
        return err, doc.get("error_type"), None
    if isinstance(doc, dict) and "detail" in doc:
        return str(doc["detail"]), None, None
    return body[:200].decode("utf-8", "replace"), None, None
