"""Why a job's run failed, and whether running it again later can succeed.

An accepted job (a 202) is a promise: a condition of the replica rather than of the request (its
batch queue full, the GPU out of memory for this batch, the model still loading, the replica
draining) must send the job back to the queue, never end it `failed`. Only a failure that would
repeat on every replica (bad input, an unknown kind, a bug in the request's own path) is permanent.
The decision is one pure function so that the table of cases is tested without a worker.
"""

from __future__ import annotations

from enum import Enum

from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.core.jobs import QueueFull
from embedfleet.runtime.core.oom import is_out_of_memory

# ApiError statuses that describe the replica, not the request: 429 (overloaded, queue full) and 503
# (loading, draining). Every other status is the request's own fault and would be answered again.
TRANSIENT_STATUSES = frozenset({429, 503})


class Failure(Enum):
    TRANSIENT = "transient"  # back to the queue with backoff; never ends the job
    PERMANENT = "permanent"  # the job ends `failed` with the reason


def classify(exc: BaseException) -> Failure:
    """Transient for conditions of this replica at this moment, permanent for everything else."""
    if isinstance(exc, QueueFull) or is_out_of_memory(exc):
        return Failure.TRANSIENT
    if isinstance(exc, ApiError):
        return Failure.TRANSIENT if exc.status in TRANSIENT_STATUSES else Failure.PERMANENT
    # bad input (InputTooLong, ValidationError, kinds.JobFailed, 4xx ApiErrors) and engine or code errors
    # the request itself triggers: they would repeat on any replica
    return Failure.PERMANENT


def reason(exc: BaseException) -> str:
    """The text stored on the job (as `error` when failed, `retry_reason` when sent back)."""
    if isinstance(exc, ApiError):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


def retry_after(exc: BaseException) -> float:
    """The least wait the condition itself asks for (a full queue knows when it drains), else 0."""
    if isinstance(exc, QueueFull):
        return exc.retry_after
    if isinstance(exc, ApiError) and exc.headers.get("retry-after", "").isdigit():
        return float(exc.headers["retry-after"])
    return 0.0
