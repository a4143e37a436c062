"""What flows through the batch manager (batcher.py): a request's `Job`, its queued `Item`s, the two
refusals a submit can raise, and the rows handed back. Kept apart so that callers naming a refusal
(the routes, the async worker, tenants) do not import the scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from embedfleet.runtime.tracing import RequestTrace


class QueueFull(RuntimeError):
    """Refused at admission (429): the token cap, or an expected wait beyond the caller's bound."""

    def __init__(self, message: str, retry_after: float, reason: str = "queue_tokens") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class EngineUnavailable(RuntimeError):
    """The engine process cannot be reached (split serving, `--fronts`): it died or is restarting (503)."""


class RequestTooLarge(ValueError):
    """A request or its answer is over what the engine link carries in one frame (split serving): 413 for that
    request alone."""


class DeadlineUnmet(RuntimeError):
    """The request's deadline cannot be met (at admission) or has passed while it was queued (504)."""


@dataclass(eq=False)
class Job:
    """One request's inputs on their way through the engine."""

    inputs: Sequence  # token sequences; len() is the token count
    urgent: bool
    future: asyncio.Future
    remaining: int
    rows: np.ndarray | None = None  # fixed-width rows, in input order, filled batch by batch (allocated at the first)
    results: list[np.ndarray | None] = field(default_factory=list)  # ragged rows (a list per input), likewise
    cancelled: bool = False
    deadline: float | None = None  # time.monotonic() after which nobody reads the answer
    promote_at: float | None = None  # bulk work waiting past its bound (time.monotonic()) is served as urgent
    bound: float | None = None  # the expected-wait bound it was admitted under (seconds)
    promised: float | None = None  # time.monotonic() by which it was promised to finish (from its arrival)
    alone: bool = False  # admitted past its bound, only because nothing was ahead of it (an empty queue admits)
    queued_tokens: int = 0  # of this job's inputs still waiting (not yet taken into a batch)
    queued_items: int = 0
    dropped: bool = False  # its remaining queue items are skipped by the planner
    tenant: str = ""  # fairness across tenants of one class (core/batching.py) and per-tenant metrics
    admitted_at: float = 0.0  # time.monotonic() at admission (queue wait is measured from here)
    trace: RequestTrace | None = None  # its spans, when tracing is on and it is sampled (tracing.py)
    started_at: float | None = None  # time.monotonic() when its first batch started on the engine
    inference_s: float = 0.0  # engine time of the batches its inputs ran in, each batch counted once
    _last_batch: float | None = None  # the start (perf_counter) of the last batch counted in inference_s

    def ran(self, started: float, seconds: float, on_engine: float) -> None:
        """Some of its inputs ran in the batch that started at `started` (perf_counter) and took `seconds`
        of engine time; `on_engine`: that start on the admission clock. Each batch counts once."""
        if self._last_batch != started:
            if self._last_batch is None:
                self.started_at = on_engine
            self._last_batch = started
            self.inference_s += seconds

    @property
    def queue_s(self) -> float:
        """Seconds from admission until its first batch started on the engine (0 until one has run)."""
        return 0.0 if self.started_at is None else self.started_at - self.admitted_at


class Item:
    """One queued input, and its own entry for the planner (core/batching.py reads `seq`, `length`, `urgent`
    and `tenant`): a plan reads them for the whole queue, and a GPU's queue holds thousands of inputs, so
    they are plain attributes, set once at submit (`length` from the caller, which measured every input
    once) rather than a second object per input or a property read on every plan."""

    __slots__ = ("index", "job", "length", "seq", "tenant", "urgent")

    def __init__(self, job: Job, index: int, seq: int, length: int | None = None) -> None:
        self.job, self.index, self.seq = job, index, seq
        self.length = len(job.inputs[index]) if length is None else length
        self.urgent, self.tenant = job.urgent, job.tenant

    def renumber(self, seq: int) -> None:
        """A new place in the queue (promotion: the job's urgency changed with it)."""
        self.seq = seq
        self.urgent = self.job.urgent


def scatter(batch: list[Item], rows: np.ndarray, started: float, seconds: float, on_engine: float) -> None:
    """Fixed-width rows into each request's own array, a block copy per request and batch rather than
    a row at a time: a GPU batch holds a thousand inputs, and a request's inputs sit side by side in
    it more often than not (the planner groups by length, or packs the oldest, and a request's texts are
    often alike).
    A request of one input gets its row as a view (the single query's path: no copy, no allocation).
    On the loop, for a batch the engine answered with one row per input (the batch manager checks
    that); `seconds`: its engine time, `on_engine`: its start on the admission clock (`Job.ran`)."""
    positions: dict[Job, list[int]] = {}
    for pos, item in enumerate(batch):
        positions.setdefault(item.job, []).append(pos)
    for job, where in positions.items():
        if job.future.done():
            continue
        job.ran(started, seconds, on_engine)
        job.remaining -= len(where)
        if len(job.inputs) == 1:
            job.future.set_result(rows[where[0]][np.newaxis])
            continue
        if job.rows is None:
            job.rows = np.empty((len(job.inputs), *rows.shape[1:]), rows.dtype)
        first, last = batch[where[0]].index, batch[where[-1]].index
        # a batch is in queue order, so a request's inputs in it are in input order
        if where[-1] - where[0] == last - first == len(where) - 1:  # and here side by side
            job.rows[first:last + 1] = rows[where[0]:where[-1] + 1]
        else:
            job.rows[[batch[pos].index for pos in where]] = rows[where]
        if job.remaining == 0:
            job.future.set_result(job.rows)
