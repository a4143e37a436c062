"""Backfill output: numbered shards plus `manifest.json`, every file written atomically.

A shard is written to a temporary name, flushed, fsynced and renamed into place, and only then
recorded in the manifest (itself replaced atomically). So after a crash at any instant the
directory holds whole shards only, and the manifest never lists a shard that is not whole: `--resume`
trusts exactly the shards the manifest names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import orjson

from .errors import InputError

MANIFEST = "manifest.json"
OUT_FORMATS = ("parquet", "npy")
# Parameters that must match for --resume to continue a run instead of mixing two different ones.
RESUME_KEYS = (
    "input",
    "input_size",
    "input_format",
    "text_field",
    "shard_size",
    "out_format",
    "model",
    "dimensions",
)


@dataclass
class Manifest:
    input: str
    input_size: int
    input_format: str
    text_field: str
    shard_size: int
    out_format: str
    model: str | None
    dimensions: int | None
    total_rows: int
    dim: int | None = None
    shards: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # shard number -> file/start/stop/rows/bytes
    complete: bool = False
    version: int = 1

    def shard_count(self) -> int:
        return -(-self.total_rows // self.shard_size)

    def done_rows(self) -> int:
        return sum(int(s["rows"]) for s in self.shards.values())


def shard_name(number: int, out_format: str) -> str:
    return f"part-{number:05d}.{out_format}"


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(directory: str, name: str, write: Any) -> int:
    """Write via `write(file)` to a temp file, then rename to `name`. Returns the size in bytes."""
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return size


def encode_shard(start: int, vectors: np.ndarray, out_format: str) -> memoryview:
    """One shard's file bytes, built column-wise from the contiguous `(rows, dim)` float32 array.

    Parquet: `row` int64 and `embedding` FixedSizeList<float32> whose values buffer wraps `vectors`
    without a per-row step. No dictionary and no compression for the vectors: float32 embeddings do
    not repeat and barely compress, and both cost more time than the whole embedding call.
    """
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if out_format == "npy":
        import io

        buf = io.BytesIO()
        np.save(buf, vectors, allow_pickle=False)
        return buf.getbuffer()
    if out_format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows, dim = vectors.shape
        table = pa.table(
            {
                "row": pa.array(np.arange(start, start + rows, dtype=np.int64)),
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim),
            }
        )
        sink = pa.BufferOutputStream()
        pq.write_table(
            table,
            sink,
            use_dictionary=False,
            compression={"row": "snappy", "embedding": "none"},
            write_statistics=["row"],
        )
        return memoryview(sink.getvalue())
    raise InputError(f"unknown output format {out_format!r}")


def write_shard(
    directory: str, number: int, start: int, vectors: np.ndarray, out_format: str
) -> dict[str, Any]:
    """Write one shard atomically; returns its manifest entry (hashed from memory, not re-read)."""
    name = shard_name(number, out_format)
    body = encode_shard(start, vectors, out_format)
    size = _atomic_write(directory, name, lambda f: f.write(body))
    return {
        "file": name,
        "start": start,
        "stop": start + len(vectors),
        "rows": len(vectors),
        "bytes": size,
        "sha256": hashlib.sha256(body).hexdigest(),
    }


def write_manifest(directory: str, manifest: Manifest) -> None:
    body = orjson.dumps(asdict(manifest), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    _atomic_write(directory, MANIFEST, lambda f: f.write(body))


def load_manifest(directory: str) -> Manifest | None:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            doc = orjson.loads(f.read())
        return Manifest(**doc)
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise InputError(f"{path} is not a manifest this version can read ({exc})") from None


def resume_mismatch(old: Manifest, new: Manifest) -> str | None:
    """Why `old` cannot be continued with the settings of `new`, or None when it can."""
    for key in RESUME_KEYS:
        if getattr(old, key) != getattr(new, key):
            return f"{key} was {getattr(old, key)!r}, now {getattr(new, key)!r}"
    return None


def trusted_shards(directory: str, manifest: Manifest) -> dict[str, dict[str, Any]]:
    """Manifest entries whose file is present with the recorded size (others will be redone)."""
    good: dict[str, dict[str, Any]] = {}
    for key, entry in manifest.shards.items():
        path = os.path.join(directory, entry["file"])
        if os.path.isfile(path) and os.path.getsize(path) == entry["bytes"]:
            good[key] = entry
    return good


def remove_temp_files(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith(".part-") or name.startswith(f".{MANIFEST}.tmp-"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


def read_shard(path: str) -> np.ndarray:
    """One shard file (.npy or .parquet) as a `(rows, dim)` float32 array."""
    if path.endswith(".npy"):
        return np.load(path, allow_pickle=False)
    import pyarrow.parquet as pq

    column = pq.read_table(path, columns=["embedding"]).column("embedding").combine_chunks()
    dim = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32, copy=False)


def read_output(directory: str) -> np.ndarray:
    """All vectors of a finished backfill, rows in input order (raises if the run is incomplete)."""
    manifest = load_manifest(directory)
    if manifest is None:
        raise InputError(f"{directory} has no {MANIFEST}")
    if not manifest.complete:
        raise InputError(f"{directory} holds an unfinished backfill; rerun it with --resume")
    parts = [
        read_shard(os.path.join(directory, manifest.shards[str(i)]["file"]))
        for i in range(manifest.shard_count())
    ]
    return np.concatenate(parts)
