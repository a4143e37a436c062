"""Where one request's time in the server went: tokenization, waiting for the engine, the engine itself.

TEI answers every request with `x-total-time`, `x-tokenization-time`, `x-queue-time` and
`x-inference-time` (milliseconds), and load tests and dashboards built for TEI read them; the same
figures also go out as entries of the standard `server-timing` header (`total;dur=..,
tokenize;dur=.., queue;dur=.., inference;dur=..`), which browsers' developer tools and our gateway
(it reads `total`) understand. Split this way, a latency figure says whether the time was the model's
(inference), the batch ahead of it (queue) or the server's own path (the rest of total), measured in
the one process that served the request: a benchmark comparing a server with an in-process model in
another process also compares two processes' forward passes, which on a small machine differ by more
than the overhead being measured.

The gate starts a `RequestTiming` per admitted request (a context variable, as tracing's is); the
hooks that have no request at hand (tokenization and the wait for the batch manager, in service.py)
add to it. Work that no request is waiting on (async jobs, probes) finds none and records nothing.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass

_CURRENT: ContextVar[RequestTiming | None] = ContextVar("embedfleet_request_timing", default=None)


@dataclass(slots=True)
class RequestTiming:
    tokenize_s: float = 0.0
    queue_s: float = 0.0  # from admission to the batch manager until the first of its inputs ran
    inference_s: float = 0.0  # engine time of the batches its inputs ran in (each batch once)
    _token: Token | None = None

    def begin(self) -> RequestTiming:
        self._token = _CURRENT.set(self)
        return self

    def end(self) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None

    def tokenized(self, seconds: float) -> None:
        self.tokenize_s += seconds

    def ran(self, queue_s: float, inference_s: float) -> None:
        """One batch-manager job of this request done (a request may submit more than one)."""
        self.queue_s = max(self.queue_s, queue_s)
        self.inference_s += inference_s

    def headers(self, total_ms: float) -> list[tuple[bytes, bytes]]:
        """`server-timing` with every part, and TEI's headers (whole milliseconds, as TEI sends them)."""
        tok, queue, inference = self.tokenize_s * 1000, self.queue_s * 1000, self.inference_s * 1000
        return [(b"server-timing", b"total;dur=%.2f, tokenize;dur=%.3f, queue;dur=%.3f, inference;dur=%.3f"
                 % (total_ms, tok, queue, inference)),
                (b"x-total-time", b"%d" % round(total_ms)), (b"x-tokenization-time", b"%d" % round(tok)),
                (b"x-queue-time", b"%d" % round(queue)), (b"x-inference-time", b"%d" % round(inference))]


def current_timing() -> RequestTiming | None:
    """The timing of the request this task serves; None outside a request (async jobs, probes)."""
    return _CURRENT.get()
