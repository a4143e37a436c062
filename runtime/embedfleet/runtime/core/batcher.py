"""The batch manager: one asyncio task feeding one engine thread.

Requests enqueue their tokenized inputs and await a future; the scheduler plans a batch with
`plan_batch` whenever the engine is free, runs it on the engine thread, and scatters rows back in
each request's input order. Work whose client has gone is dropped before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from embedfleet.runtime.core.batching import DEFAULT_OVERHEAD_TOKENS, Entry, plan_batch
from embedfleet.runtime.metrics import ModelMetrics

log = logging.getLogger(__name__)

MIN_BULK_TOKENS = 512
EngineFn = Callable[[list], np.ndarray]  # a batch of inputs (anything with len()) -> rows


class QueueFull(RuntimeError):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """One request's inputs on their way through the engine."""

    inputs: Sequence  # token sequences; len() is the token count
    urgent: bool
    future: asyncio.Future
    remaining: int
    results: list[np.ndarray | None] = field(default_factory=list)
    cancelled: bool = False


@dataclass(eq=False, slots=True)
class Item:
    job: Job
    index: int
    seq: int

    @property
    def length(self) -> int:
        return len(self.job.inputs[self.index])


class BatchManager:
    def __init__(self, engine_fn: EngineFn, max_batch_tokens: int, max_batch_requests: int,
                 max_queue_tokens: int, metrics: ModelMetrics, engine_thread: ThreadPoolExecutor,
                 overhead_tokens: int = DEFAULT_OVERHEAD_TOKENS, bulk_batch_seconds: float = 0.0) -> None:
        self.engine_fn = engine_fn
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.max_queue_tokens = max_queue_tokens
        self.overhead_tokens = overhead_tokens
        self.bulk_batch_seconds = bulk_batch_seconds
        self.metrics = metrics
        self._queue: list[Item] = []
        self._queued_tokens = 0
        self._seq = 0
        self._wake = asyncio.Event()
        self._engine = engine_thread  # the one thread that ever touches the model (see ModelService.load)
        self._task: asyncio.Task | None = None
        self._tokens_per_s = 0.0
        metrics.max_batch_requests.set(max_batch_requests)
        metrics.max_batch_tokens.set(max_batch_tokens)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-manager")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    # -- public ----------------------------------------------------------------------------
    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def saturated(self) -> bool:
        return self._queued_tokens >= self.max_queue_tokens

    def expected_wait(self) -> float:
        return self._queued_tokens / self._tokens_per_s if self._tokens_per_s else 0.0

    def submit(self, inputs: Sequence, urgent: bool) -> Job:
        """Queue a request's inputs; await `job.future` for the rows in input order."""
        tokens = sum(len(x) for x in inputs)
        if self._queued_tokens and self._queued_tokens + tokens > self.max_queue_tokens:
            raise QueueFull(
                f"the queue holds {self._queued_tokens} tokens; adding {tokens} would pass the limit "
                f"of {self.max_queue_tokens}", retry_after=max(1.0, self.expected_wait()))
        job = Job(inputs, urgent, asyncio.get_running_loop().create_future(), remaining=len(inputs),
                  results=[None] * len(inputs))
        for i in range(len(inputs)):
            self._queue.append(Item(job, i, self._seq))
            self._seq += 1
        self._queued_tokens += tokens
        self._update_gauges()
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: its queued inputs never reach the engine."""
        if job.future.done():
            return
        job.cancelled = True
        kept = []
        for item in self._queue:
            if item.job is job:
                self._queued_tokens -= item.length
            else:
                kept.append(item)
        self._queue = kept
        job.future.cancel()
        self._update_gauges()

    # -- scheduler -------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        self.metrics.queue_tokens.set(self._queued_tokens)
        self.metrics.queue_requests.set(len({id(item.job) for item in self._queue}))
        self.metrics.expected_wait.set(self.expected_wait())

    def _budget(self, entries: list[Entry]) -> int:
        """Urgent batches may use the whole token budget; bulk ones are cut to `bulk_batch_seconds` of
        measured engine time, so a query arriving mid-backfill never waits behind a long batch."""
        if not self.bulk_batch_seconds or not self._tokens_per_s or any(e.urgent for e in entries):
            return self.max_batch_tokens
        floor = min(self.max_batch_tokens, MIN_BULK_TOKENS)  # never starve bulk work into tiny batches
        return max(floor, min(self.max_batch_tokens, int(self.bulk_batch_seconds * self._tokens_per_s)))

    def _take_batch(self) -> list[Item]:
        entries = [Entry(item.seq, item.length, item.job.urgent) for item in self._queue]
        chosen = set(plan_batch(entries, self._budget(entries), self.max_batch_requests, self.overhead_tokens))
        batch = [self._queue[i] for i in sorted(chosen)]
        self._queue = [item for i, item in enumerate(self._queue) if i not in chosen]
        self._queued_tokens -= sum(item.length for item in batch)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take_batch()
            self._update_gauges()
            inputs = [item.job.inputs[item.index] for item in batch]
            started = time.perf_counter()
            try:
                rows = await loop.run_in_executor(self._engine, self.engine_fn, inputs)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine failed this batch: fail its requests, keep serving
                log.exception("engine failed a batch of %d inputs", len(batch))
                for item in batch:
                    if not item.job.future.done():
                        item.job.future.set_exception(exc)
                continue
            self._record(batch, inputs, time.perf_counter() - started)
            for item, row in zip(batch, rows, strict=True):
                job = item.job
                if job.future.done():
                    continue
                job.results[item.index] = row
                job.remaining -= 1
                if job.remaining == 0:
                    job.future.set_result(np.stack(job.results))

    def _record(self, batch: list[Item], inputs: list, seconds: float) -> None:
        tokens = sum(len(x) for x in inputs)
        self.metrics.batch_size.observe(len(batch))
        self.metrics.batch_tokens.observe(max(len(x) for x in inputs) * len(inputs))
        self.metrics.inputs.inc(len(batch))
        self.metrics.tokens.inc(tokens)
        self.metrics.engine_busy.inc(seconds)
        rate = tokens / seconds if seconds > 0 else 0.0
        self._tokens_per_s = rate if not self._tokens_per_s else 0.8 * self._tokens_per_s + 0.2 * rate
        self._update_gauges()
