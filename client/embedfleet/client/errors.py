"""Exceptions raised by the client.

Every failure a caller can act on has its own type, so a backfill can tell "the server is down"
(retry later) from "row 17 is empty" (fix the input) without parsing messages.
"""

from __future__ import annotations

from dataclasses import dataclass


class ClientError(Exception):
    """Base class of everything `embedfleet.client` raises on purpose."""


class InputError(ClientError, ValueError):
    """The caller's input cannot be sent (empty text, not a string, nothing to embed)."""


class TransportError(ClientError):
    """The request never got an HTTP answer: refused, reset, dropped or timed out. Retryable."""


class ServerError(ClientError):
    """The server answered with an HTTP error status.

    `retryable` is decided once, from the status code, so the retry loop and the caller agree.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        code: str | int | None = None,
        retry_after: float | None = None,
        url: str = "",
    ) -> None:
        super().__init__(f"HTTP {status} from {url}: {message}" if url else f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.retry_after = retry_after
        self.url = url

    @property
    def retryable(self) -> bool:
        return self.status in (408, 425, 429) or (self.status >= 500 and self.status not in (501, 505))


class ResponseMismatchError(ClientError):
    """The server answered 200 but with the wrong shape: wrong row count, wrong dimension, bad JSON.

    Never retried silently into a result: a server that miscounts once may miscount rows we cannot see.
    """


@dataclass(frozen=True)
class FailedBatch:
    """One batch that could not be completed: inputs `start` (inclusive) to `stop` (exclusive)."""

    start: int
    stop: int
    error: BaseException

    def describe(self) -> str:
        rows = (
            f"input {self.start}" if self.stop - self.start == 1 else f"inputs {self.start}-{self.stop - 1}"
        )
        return f"{rows}: {self.error}"


class BatchFailedError(ClientError):
    """At least one batch failed after its retries; no partial array is returned.

    `failures` names each failed range of inputs, so a caller can re-send exactly those.
    """

    def __init__(self, failures: list[FailedBatch], total: int) -> None:
        self.failures = sorted(failures, key=lambda f: f.start)
        self.total = total
        shown = "; ".join(f.describe() for f in self.failures[:3])
        more = f" (and {len(self.failures) - 3} more batches)" if len(self.failures) > 3 else ""
        super().__init__(f"{self.failed_count} of {total} inputs failed: {shown}{more}")

    @property
    def failed_indices(self) -> list[int]:
        return [i for f in self.failures for i in range(f.start, f.stop)]

    @property
    def failed_count(self) -> int:
        return sum(f.stop - f.start for f in self.failures)


class DeadlineExceeded(BatchFailedError, TimeoutError):
    """The call's total deadline passed before every batch was answered."""
