"""The backfill: a file of texts -> shards of vectors, resumable, through one shared client.

Shards are the unit of progress: each is embedded (many requests in flight), written atomically,
then recorded in the manifest. `pipeline.run_pipeline` overlaps the stages: the next chunk is read
and the last shard written while a few chunks' requests are in flight (one client-wide cap of
`--max-concurrent-requests`), so the requests never drain between shards. A crash, a SIGKILL or
Ctrl-C loses at most the shards still in flight; shards complete out of order, the manifest says
which are whole, and `--resume` redoes exactly the others.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .aio import AsyncClient
from .errors import BatchFailedError, ClientError, FailedBatch, InputError, ResponseMismatchError
from .pipeline import Chunk, Embedded, PipelineStats, chunks_held_bound, pending_chunks, run_pipeline
from .retry import RetryPolicy
from .shards import (
    Manifest,
    load_manifest,
    remove_temp_files,
    resume_mismatch,
    trusted_shards,
    write_manifest,
    write_shard,
)
from .sources import detect_format, iter_texts

# (directory, shard number, first row, vectors, format) -> manifest entry; see `shards.write_shard`.
ShardWriter = Callable[[str, int, int, np.ndarray, str], dict[str, Any]]


@dataclass
class BackfillConfig:
    input: str
    out: str
    urls: Sequence[str]
    input_format: str | None = None
    text_field: str = "text"
    out_format: str = "parquet"
    shard_size: int = 10_000
    model: str | None = None
    dimensions: int | None = None
    encoding_format: str = "base64"
    batch_size: int = 128
    max_concurrent_requests: int = 64
    shards_in_flight: int = 2
    resume: bool = False
    api_key: str | None = None
    request_timeout: float = 60.0
    max_retries: int = 5
    hedge_delay: float | None = None
    spread: bool = False


@dataclass
class BackfillSummary:
    out: str
    total_rows: int
    rows_written: int = 0
    rows_skipped: int = 0
    shards_written: int = 0
    shards_skipped: int = 0
    seconds: float = 0.0
    retries: int = 0
    hedges: int = 0
    requests: int = 0
    interrupted: bool = False
    dim: int | None = None
    peak_chunks_held: int = 0  # most chunks in memory at once; never above `chunk_bound`
    chunk_bound: int = 0
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        rate = self.rows_written / self.seconds if self.seconds > 0 else 0.0
        state = "interrupted" if self.interrupted else ("failed" if self.errors else "done")
        done = self.rows_written + self.rows_skipped
        return (
            f"embedfleet embed: {state}: {done}/{self.total_rows} rows in {self.out} "
            f"({self.shards_written} shards written, {self.shards_skipped} resumed) "
            f"in {self.seconds:.1f}s, {rate:,.0f} emb/s, {self.requests} requests, "
            f"{self.retries} retries, {self.hedges} hedges"
        )


def validate_input(path: str, fmt: str, text_field: str) -> int:
    """Read the whole input once, counting rows; raises `InputError` naming the first bad row."""
    count = 0
    for _ in iter_texts(path, fmt, text_field):
        count += 1
    if count == 0:
        raise InputError(f"{path}: no texts to embed")
    return count


def prepare_output(cfg: BackfillConfig, fresh: Manifest) -> Manifest:
    """Create or reopen the output directory; returns the manifest to continue from."""
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise InputError(f"--out {cfg.out} exists and is not a directory")
    os.makedirs(cfg.out, exist_ok=True)
    old = load_manifest(cfg.out)
    if old is not None and not cfg.resume:
        raise InputError(
            f"{cfg.out} already holds a backfill; pass --resume to continue it or pick a new --out"
        )
    if old is None and cfg.resume and any(not n.startswith(".") for n in os.listdir(cfg.out)):
        raise InputError(f"{cfg.out} has files but no manifest.json; nothing to resume")
    if old is None and not cfg.resume and any(not n.startswith(".") for n in os.listdir(cfg.out)):
        raise InputError(f"{cfg.out} is not empty; pick an empty or new directory")
    remove_temp_files(cfg.out)
    if old is None:
        write_manifest(cfg.out, fresh)
        return fresh
    why = resume_mismatch(old, fresh)
    if why:
        raise InputError(f"cannot resume {cfg.out}: {why}; use a new --out")
    old.shards = trusted_shards(cfg.out, old)
    old.complete = False
    return old


def open_backfill(cfg: BackfillConfig) -> tuple[str, str, int, Manifest]:
    """Validate the input and open the output: (input path, input format, row count, manifest)."""
    if cfg.shard_size < 1:
        raise InputError("--shard-size must be >= 1")
    if cfg.shards_in_flight < 1:
        raise InputError("--shards-in-flight must be >= 1")
    fmt = detect_format(cfg.input, cfg.input_format)
    path = os.path.abspath(cfg.input)
    total = validate_input(path, fmt, cfg.text_field)
    fresh = Manifest(
        input=path,
        input_size=os.path.getsize(path),
        input_format=fmt,
        text_field=cfg.text_field,
        shard_size=cfg.shard_size,
        out_format=cfg.out_format,
        model=cfg.model,
        dimensions=cfg.dimensions,
        total_rows=total,
    )
    return path, fmt, total, prepare_output(cfg, fresh)


async def run_backfill(
    cfg: BackfillConfig,
    stop: asyncio.Event | None = None,
    progress: Callable[[int, int], None] | None = None,
    on_total: Callable[[int, int], None] | None = None,
    writer: ShardWriter = write_shard,
) -> BackfillSummary:
    """Embed `cfg.input` into `cfg.out`. `stop` set -> finish writing what is done and return early.

    `progress(rows, failed_requests_so_far)` is called as each batch lands. `writer` writes one
    shard (the default is `shards.write_shard`; tests slow it down to check back-pressure).

    Raises `InputError` for bad input/output settings and `BatchFailedError` (rows named in global
    input numbering) when the servers fail a batch; shards already written stay valid for --resume.
    """
    stop = stop or asyncio.Event()
    path, fmt, total, manifest = await asyncio.to_thread(open_backfill, cfg)
    summary = BackfillSummary(out=cfg.out, total_rows=total, dim=manifest.dim)
    summary.shards_skipped = len(manifest.shards)
    summary.rows_skipped = manifest.done_rows()
    summary.chunk_bound = chunks_held_bound(cfg.shards_in_flight)
    if on_total is not None:
        on_total(total, summary.rows_skipped)
    client = AsyncClient(
        cfg.urls,
        model=cfg.model,
        api_key=cfg.api_key,
        batch_size=cfg.batch_size,
        max_concurrent_requests=cfg.max_concurrent_requests,
        max_requests_total=cfg.max_concurrent_requests,  # one cap over all chunks in flight
        request_timeout=cfg.request_timeout,
        retry=RetryPolicy(max_retries=cfg.max_retries),
        hedge_delay=cfg.hedge_delay,
        spread=cfg.spread,
        encoding_format=cfg.encoding_format,
    )
    stats = PipelineStats()
    t0 = time.perf_counter()

    def on_batch(rows: int) -> None:
        if progress is not None:
            progress(rows, client.request_errors)

    async def embed(chunk: Chunk) -> np.ndarray:
        try:
            result = await client.embed_detailed(chunk.texts, dimensions=cfg.dimensions, on_batch=on_batch)
        except BatchFailedError as exc:
            shifted = [FailedBatch(f.start + chunk.start, f.stop + chunk.start, f.error) for f in exc.failures]
            raise type(exc)(shifted, total) from None
        return result.embeddings

    def record(item: Embedded) -> None:
        """In the writer thread, the only one touching the manifest while the pipeline runs: the
        shard, then its manifest entry (a crash in between leaves the shard unlisted, to be redone)."""
        dim = int(item.vectors.shape[1])
        if manifest.dim is not None and dim != manifest.dim:
            err = ResponseMismatchError(f"dimension {dim}, earlier shards have {manifest.dim}")
            raise BatchFailedError([FailedBatch(item.start, item.start + len(item.vectors), err)], total)
        entry = writer(cfg.out, item.number, item.start, item.vectors, cfg.out_format)
        manifest.dim = dim
        manifest.shards[str(item.number)] = entry
        write_manifest(cfg.out, manifest)
        summary.shards_written += 1
        summary.rows_written += len(item.vectors)

    done = {int(k) for k in manifest.shards}
    chunks = pending_chunks(iter_texts(path, fmt, cfg.text_field), cfg.shard_size, done)
    try:
        await run_pipeline(chunks, embed, record, stop, cfg.shards_in_flight, stats)
    finally:
        await client.close()
        summary.seconds = time.perf_counter() - t0
        summary.requests = client.stats.requests
        summary.retries = client.stats.retries
        summary.hedges = client.stats.hedges
        summary.dim = manifest.dim
        summary.peak_chunks_held = stats.peak_held
    summary.interrupted = stop.is_set()
    if not summary.interrupted and len(manifest.shards) == manifest.shard_count():
        manifest.complete = True
        write_manifest(cfg.out, manifest)
    return summary


__all__ = ["BackfillConfig", "BackfillSummary", "ClientError", "run_backfill"]
