"""Input files for the backfill: JSONL (one field), plain text (a line each) or Parquet (one column).

Every reader yields texts in file order and raises `InputError` naming the line or row of the first
bad record, so a typo in row 3,000,017 is found by the validation pass, before anything is sent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import orjson

from .errors import InputError

FORMATS = ("jsonl", "text", "parquet")


def detect_format(path: str, explicit: str | None = None) -> str:
    """The input format: as given, else by suffix (.jsonl/.ndjson/.json, .parquet/.pq, else text)."""
    if explicit and explicit != "auto":
        if explicit not in FORMATS:
            raise InputError(f"unknown input format {explicit!r}; choose one of {', '.join(FORMATS)}")
        return explicit
    lower = path.lower()
    if lower.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if lower.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"


def iter_texts(path: str, fmt: str, text_field: str = "text") -> Iterator[str]:
    """Texts of `path` in order; `InputError` (naming the line/row) on the first unusable record."""
    if not os.path.exists(path):
        raise InputError(f"input file not found: {path}")
    if os.path.isdir(path):
        raise InputError(f"input is a directory, not a file: {path}")
    if fmt == "jsonl":
        return _iter_jsonl(path, text_field)
    if fmt == "text":
        return _iter_lines(path)
    if fmt == "parquet":
        return _iter_parquet(path, text_field)
    raise InputError(f"unknown input format {fmt!r}")


def _lines(path: str) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}: line {number} is not valid UTF-8 ({exc.reason})") from None


def _iter_lines(path: str) -> Iterator[str]:
    for number, line in _lines(path):
        if not line.strip():
            raise InputError(f"{path}: line {number} is empty (every line is one text)")
        yield line


def _iter_jsonl(path: str, field: str) -> Iterator[str]:
    # orjson parses the raw bytes (checking UTF-8 itself): no str per line before the parse. This loop
    # runs twice per backfill (validation, then reading), so its per-line cost is the reader's cost.
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank separator lines carry no record in JSONL
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    raise InputError(f"{path}: line {number} is not valid UTF-8 ({bad.reason})") from None
                raise InputError(f"{path}: line {number} is not valid JSON ({exc})") from None
            text = record.get(field) if type(record) is dict else None
            yield text if type(text) is str and text else _field(path, number, record, field)


def _field(path: str, number: int, record: object, field: str) -> str:
    """The text of one JSONL record, or `InputError` saying what is wrong with it."""
    if not isinstance(record, dict):
        raise InputError(f"{path}: line {number} is not a JSON object")
    if field not in record:
        raise InputError(f"{path}: line {number} has no field {field!r} (fields: {', '.join(record)})")
    text = record[field]
    if not isinstance(text, str):
        raise InputError(f"{path}: line {number} field {field!r} is {type(text).__name__}, not a string")
    if not text:
        raise InputError(f"{path}: line {number} field {field!r} is empty")
    return text


def _iter_parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise InputError(f"{path}: no column {field!r} (columns: {', '.join(names)})")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=8192):
        column = batch.column(0)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise InputError(f"{path}: column {field!r} has type {column.type}, not string")
        for text in column.to_pylist():
            if text is None or not text:
                raise InputError(
                    f"{path}: row {row} column {field!r} is {'null' if text is None else 'empty'}"
                )
            yield text
            row += 1
