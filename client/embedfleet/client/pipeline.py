"""The backfill's pipeline: read the next chunk, embed a few, write the finished ones, all at once.

Three stages joined by bounded hand-offs, so the file never waits on the network or the reverse:

    reader  (a worker thread)  reads chunk k+1 while chunk k's requests are in flight
    embed   (the event loop)   up to `embed_slots` chunks have requests in flight or wait, embedded,
                               for the writer; a chunk's slot is freed when the writer takes it
    writer  (one worker thread) writes shards one after another, in the order they finished

A slow writer therefore stalls nothing until `embed_slots` finished chunks wait for it; then no new
chunk starts (back-pressure), and memory never holds more than `chunks_held_bound` chunks.

Stopping (Ctrl-C, or the first failure) reads nothing more and abandons the requests in flight, but
every chunk whose vectors have arrived is still written: they cost a full round of requests.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Chunk:
    """`texts` are input rows `start .. start + len(texts)`; `number` names its shard."""

    number: int
    start: int
    texts: list[str]


@dataclass(frozen=True)
class Embedded:
    number: int
    start: int
    vectors: np.ndarray  # (rows, dim) float32, rows in input order


def chunks_held_bound(embed_slots: int) -> int:
    """Most chunks in memory at once: one being read, `embed_slots` embedding or waiting, one writing."""
    return max(1, embed_slots) + 2


def pending_chunks(texts: Iterator[str], size: int, done: Collection[int]) -> Iterator[Chunk]:
    """Chunks of `size` texts numbered from 0, leaving out the numbers in `done` (resumed shards)."""
    for number in itertools.count():
        batch = list(itertools.islice(texts, size))
        if not batch:
            return
        if number not in done:
            yield Chunk(number, number * size, batch)


@dataclass
class PipelineStats:
    chunks_read: int = 0
    chunks_written: int = 0
    held: int = 0  # chunks read and not yet written (or dropped)
    peak_held: int = 0

    def take(self) -> None:
        self.chunks_read += 1
        self.held += 1
        self.peak_held = max(self.peak_held, self.held)

    def drop(self, written: bool) -> None:
        self.held -= 1
        self.chunks_written += written


async def run_pipeline(
    chunks: Iterator[Chunk],
    embed: Callable[[Chunk], Awaitable[np.ndarray]],
    write: Callable[[Embedded], None],
    stop: asyncio.Event,
    embed_slots: int = 2,
    stats: PipelineStats | None = None,
) -> PipelineStats:
    """Run the three stages until `chunks` ends or `stop` is set; raises the first failure.

    `embed` runs on the loop (many requests per chunk); `write` runs in the writer thread and may
    block. The first failure of either sets `stop` and is raised once everything in flight has
    settled (chunks already embedded are still written, unless a write itself failed).
    """
    stats = stats or PipelineStats()
    slots = asyncio.Semaphore(max(1, embed_slots))
    finished: asyncio.Queue[Embedded | None] = asyncio.Queue()  # bounded by `slots`, never blocks a put
    failures: list[BaseException] = []
    embedding: set[asyncio.Task[None]] = set()

    def fail(exc: BaseException) -> None:
        failures.append(exc)
        stop.set()

    async def embed_one(chunk: Chunk) -> None:
        queued = False
        try:
            vectors = await embed(chunk)
            finished.put_nowait(Embedded(chunk.number, chunk.start, vectors))
            queued = True
        except Exception as exc:  # reported once in-flight work has settled
            fail(exc)
        finally:
            if not queued:
                slots.release()
                stats.drop(written=False)

    async def writer() -> None:
        write_failed = False
        while (item := await finished.get()) is not None:
            slots.release()  # the writer holds this chunk now: the embed stage may start another
            if write_failed:
                stats.drop(written=False)  # a write already failed (disk full?): do not try more
                continue
            try:
                # A thread cannot be cancelled: once started, a shard and its manifest entry land.
                await asyncio.to_thread(write, item)
                stats.drop(written=True)
            except Exception as exc:  # reported once in-flight work has settled
                stats.drop(written=False)
                write_failed = True
                fail(exc)

    def read_next() -> Awaitable[Chunk | None]:
        return asyncio.ensure_future(asyncio.to_thread(next, chunks, None))

    writing = asyncio.ensure_future(writer())
    reading = read_next()
    try:
        while not stop.is_set():
            chunk = await reading
            reading = None
            if chunk is None:
                break
            stats.take()
            await slots.acquire()
            if stop.is_set():
                slots.release()
                stats.drop(written=False)
                break
            task = asyncio.ensure_future(embed_one(chunk))
            embedding.add(task)
            task.add_done_callback(embedding.discard)
            reading = read_next()  # the next chunk is read while this one's requests are in flight
        if embedding and not stop.is_set():
            stopper = asyncio.ensure_future(stop.wait())
            pending = set(embedding)
            while pending and not stop.is_set():
                _, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(stopper)
            stopper.cancel()
    finally:
        for task in list(embedding):
            task.cancel()
        await asyncio.gather(*embedding, return_exceptions=True)
        if reading is not None:  # a read in its thread finishes anyway; its chunk is not needed
            await asyncio.gather(reading, return_exceptions=True)
        finished.put_nowait(None)
        await writing
    if failures:
        raise failures[0]
    return stats


__all__ = ["Chunk", "Embedded", "PipelineStats", "chunks_held_bound", "pending_chunks", "run_pipeline"]
