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


class DeadlineUnmet(RuntimeError):
    """The request's deadline cannot be met (at admission) or has passed while it was queued (504)."""


@dataclass(eq=False)
class Job:
    """One request's inputs on their way through the engine."""

    inputs: Sequence  # token sequences; len() is the token count
    urgent: bool
    future: asyncio.Future
    remaining: int
    results: list[np.ndarray | None] = field(default_factory=list)
    cancelled: bool = False
    deadline: float | None = None  # time.monotonic() after which nobody reads the answer
    promote_at: float | None = None  # bulk work waiting past its bound (time.monotonic()) is served as urgent
    bound: float | None = None  # the expected-wait bound it was admitted under (seconds)
    promised: float | None = None  # time.monotonic() by which it was promised to finish (from its arrival)
    queued_tokens: int = 0  # of this job's inputs still waiting (not yet taken into a batch)
    queued_items: int = 0
    dropped: bool = False  # its remaining queue items are skipped by the planner
    tenant: str = ""  # fairness across tenants of one class (core/batching.py) and per-tenant metrics
    admitted_at: float = 0.0  # time.monotonic() at admission (queue wait is measured from here)
    trace: RequestTrace | None = None  # its spans, when tracing is on and it is sampled (tracing.py)
    started_at: float | None = None  # time.monotonic() when its first batch started on the engine
    inference_s: float = 0.0  # engine time of the batches its inputs ran in, each batch counted once
    _last_batch: float | None = None  # the start (perf_counter) of the last batch counted in inference_s

    @property
    def queue_s(self) -> float:
        """Seconds from admission until its first batch started on the engine (0 until one has run)."""
        return 0.0 if self.started_at is None else self.started_at - self.admitted_at


@dataclass(eq=False, slots=True)
class Item:
    job: Job
    index: int
    seq: int

    @property
    def length(self) -> int:
        return len(self.job.inputs[self.index])


def as_rows(results: list[np.ndarray]) -> np.ndarray:
    """A job's rows as one array; a lone row (the single query) as a view, without `np.stack`'s
    Python-level checks on the path from the engine to the answer."""
    return results[0][np.newaxis] if len(results) == 1 else np.stack(results)
