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
    """Parse an OpenAI embeddings response into a `(expected, dim)` float32 array in index order."""
    doc = load_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ResponseMismatchError("response has no 'data' list")
    data = doc["data"]
    if len(data) != expected:
        raise ResponseMismatchError(f"server returned {len(data)} vectors for {expected} inputs")
    out: np.ndarray | None = None
    seen = np.zeros(expected, dtype=bool)
    for pos, item in enumerate(data):
        try:
            index = item.get("index", pos)
            emb = item["embedding"]
        except (AttributeError, KeyError, TypeError):
            raise ResponseMismatchError(f"data[{pos}] has no 'embedding'") from None
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
            dim = row.shape[0]
            if dim == 0:
                raise ResponseMismatchError("server returned an empty vector")
            if dimensions is not None and dim != dimensions:
                raise ResponseMismatchError(f"server returned dimension {dim}, asked for {dimensions}")
            out = np.empty((expected, dim), dtype=np.float32)
        elif row.shape[0] != out.shape[1]:
            raise ResponseMismatchError(
                f"data[{pos}] has dimension {row.shape[0]}, earlier rows have {out.shape[1]}"
            )
        out[index] = row
    if out is None:
        return np.empty((0, dimensions or 0), dtype=np.float32), _usage(doc)
    return out, _usage(doc)


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
