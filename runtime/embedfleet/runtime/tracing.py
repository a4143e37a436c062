"""OpenTelemetry tracing of the runtime's request path, off unless asked for (docs/tracing.md).

One request is one trace below the caller's (W3C `traceparent`, as the gateway sends it):

    POST /v1/embeddings          SERVER, the gate: admission to the last byte; route, tenant, model, status
      validation                 reading and checking the body, choosing the model
      tokenization               the tokenizer pool; inputs, tokens, truncated
      queue wait                 submitted to the batcher until its first input is taken into a batch
      engine batch               per batch its inputs ran in: the batch's time, its size and tokens, the
                                 request's share, and a link to the batch's own span
      encode                     the engine's rows to the answer's first byte (body building, JSON)

An engine batch serves several requests, so it cannot be a child of each: it is one span of its own
(`batch`, the root of a trace of its own) with a link to every traced request in it, and each request
gets the child span `engine batch` above, covering the same time, so a request's trace shows where its
time went without leaving it. Spans are made only for sampled requests; input text and API keys are never
recorded.

Off (the default) costs one `if` per hook: the gate's `GateState.tracing` is None, no `RequestTrace`
exists, and every hook below tests for one. On, the setup reads the standard OTEL_* variables (endpoint,
headers, service name, resource attributes, sampler, batch processor) through the SDK itself.

The on/off rule and the provider's set-up are `embedfleet.otel`'s, shared with the gateway (which must
not import the runtime package).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING

from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer, get_current_span, set_span_in_context

from embedfleet.runtime.core.batching import batch_cost

if TYPE_CHECKING:  # the SDK is imported where tracing is set up (--otel), not by every start
    from opentelemetry.sdk.trace import TracerProvider

# Wall-clock nanoseconds of a time.perf_counter() value: the batcher times batches with perf_counter,
# and a span made after the fact needs epoch times.
_WALL0, _PERF0 = time.time_ns(), time.perf_counter()
# The request being served on this task (set by the gate, read by the hooks that have no request at hand:
# tokenization and queueing in service.py, the encode mark in api/http.py).
_CURRENT: ContextVar[RequestTrace | None] = ContextVar("embedfleet_request_trace", default=None)


def wall_ns(perf: float) -> int:
    """Epoch nanoseconds of a time.perf_counter() reading."""
    return _WALL0 + int((perf - _PERF0) * 1e9)


def current_trace() -> RequestTrace | None:
    """The trace of the request this task serves; None when tracing is off or it is not sampled."""
    return _CURRENT.get()


class RuntimeTracing:
    """The runtime's tracer, handed to the gate (GateState.tracing); None there means tracing is off."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("embedfleet.runtime")

    def begin(self, scope, route: str, tenant: str) -> RequestTrace | None:
        """The request's server span, the child of the caller's `traceparent`; None when not sampled
        (nothing more is done for it)."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate")}
        parent = propagate.extract(carrier) if carrier else Context()
        span = self.tracer.start_span(f"{scope['method']} {route}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": scope["method"], "http.route": route,
                                                  "url.path": scope["path"], "embedfleet.tenant": tenant})
        if not span.is_recording():
            span.end()
            return None
        return RequestTrace(self.tracer, span)

    def continued(self, carrier: dict[str, str]) -> RequestTrace | None:
        """A request traced by another process of this server (split serving: a front's request, run by the
        engine process): its spans here ("queue wait", "engine batch", the batch) are children of the
        front's server span, so the trace has the single process's shape. None unless it was sampled."""
        parent = propagate.extract(carrier)
        span = get_current_span(parent)
        if not span.get_span_context().is_valid or not span.get_span_context().trace_flags.sampled:
            return None
        return RequestTrace(self.tracer, span, phase=None)

    def shutdown(self) -> None:
        """Export what is still buffered, then stop (at server exit)."""
        self.provider.shutdown()


class RequestTrace:
    """One sampled request's spans. Phases follow each other on the request's own task, so each hook
    ends the phase before it; `end` closes whatever is open (a request refused mid-way)."""

    __slots__ = ("_token", "context", "model", "phase", "queue", "span", "tracer")

    def __init__(self, tracer: Tracer, span: Span, phase: str | None = "validation") -> None:
        self.tracer = tracer
        self.span = span  # continued from another process: the caller's span, which this process cannot end
        self.context = set_span_in_context(span)
        self.phase: Span | None = None if phase is None else tracer.start_span(phase, context=self.context)
        self.queue: Span | None = None
        self.model = ""
        self._token = _CURRENT.set(self)

    def _next(self, name: str | None, attributes: dict | None = None) -> None:
        if self.phase is not None:
            self.phase.end()
        self.phase = None if name is None else self.tracer.start_span(name, context=self.context,
                                                                      attributes=attributes)

    def tokenizing(self, model: str, pairs: bool) -> None:
        self.model = model
        self.span.set_attribute("embedfleet.model", model)
        self._next("tokenization", {"embedfleet.model": model, "embedfleet.pairs": pairs})

    def tokenized(self, tokenized: Sequence) -> None:
        if self.phase is not None:
            self.phase.set_attributes({"embedfleet.inputs": len(tokenized),
                                       "embedfleet.tokens": sum(len(t) for t in tokenized),
                                       "embedfleet.truncated": sum(bool(getattr(t, "truncated", False))
                                                                   for t in tokenized)})
        self._next(None)

    def queued(self, inputs: int, tokens: int, urgent: bool) -> None:
        """Submitted to the batcher: the queue wait begins (ended by `dequeued`, or by `end` if the work
        was refused or dropped before it ran)."""
        self._next(None)
        self.span.set_attributes({"embedfleet.inputs": inputs, "embedfleet.tokens": tokens})
        self.queue = self.tracer.start_span("queue wait", context=self.context, attributes={
            "embedfleet.inputs": inputs, "embedfleet.tokens": tokens, "embedfleet.urgent": urgent})

    def dequeued(self) -> None:
        """The first of its inputs was taken into a batch (later calls, for later batches, do nothing)."""
        if self.queue is not None:
            self.queue.end()
            self.queue = None

    def encoding(self) -> None:
        """The engine's rows are in: the answer is built and serialised until its first byte goes out."""
        self._next("encode")

    def responded(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            for span in (self.phase, self.queue):  # the phase that refused it
                if span is not None:
                    span.set_status(Status(StatusCode.ERROR, f"answered {status}"))
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self._next(None)

    def carrier(self) -> dict[str, str]:
        """`traceparent` (and a short `tracestate`) of this request's server span, for another process."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=self.context)
        if len(carrier.get("tracestate", "")) > 512:  # W3C's limit; a client's longer one stays here
            del carrier["tracestate"]
        return carrier

    def end(self) -> None:
        self._next(None)
        if self.queue is not None:
            self.queue.set_attribute("embedfleet.ran", False)
            self.queue.end()
            self.queue = None
        self.span.end()
        _CURRENT.reset(self._token)


def trace_batch(items: Sequence[tuple[RequestTrace | None, int]], started: float, ended: float,
                packed: bool = False) -> None:
    """After an engine batch (off the answer's path): the batch's span, linked to every traced request
    in it, and each traced request's `engine batch` span over the same time. `items`: per input of the
    batch, its request's trace (None if not traced) and its token count; `started`, `ended`:
    time.perf_counter()."""
    shares: dict[int, list] = {}
    for trace, length in items:
        if trace is not None:
            share = shares.setdefault(id(trace), [trace, 0, 0])
            share[1] += 1
            share[2] += length
    if not shares:
        return
    start, end = wall_ns(started), wall_ns(ended)
    lengths = [length for _, length in items]
    tokens, padded = sum(lengths), batch_cost(lengths, packed)
    first = next(iter(shares.values()))[0]
    attributes = {"embedfleet.model": first.model, "embedfleet.batch.size": len(items),
                  "embedfleet.batch.tokens": tokens, "embedfleet.batch.padded_tokens": padded,
                  "embedfleet.batch.requests_traced": len(shares)}
    batch = first.tracer.start_span("batch", context=Context(), start_time=start, attributes=attributes,
                              links=[Link(trace.span.get_span_context()) for trace, _, _ in shares.values()])
    batch.end(end_time=end)
    batch_link = [Link(batch.get_span_context())]
    for trace, inputs, request_tokens in shares.values():
        span = trace.tracer.start_span("engine batch", context=trace.context, start_time=start, links=batch_link,
                                       attributes={**attributes, "embedfleet.inputs": inputs,
                                                   "embedfleet.tokens": request_tokens})
        span.end(end_time=end)
