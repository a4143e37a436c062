"""OpenTelemetry tracing of the gateway's proxying, off unless asked for (docs/tracing.md).

On (--otel, EMBEDFLEET_OTEL, or OTEL_TRACES_EXPORTER naming an exporter), each work request gets a
SERVER span that starts or continues the client's trace (W3C `traceparent`), and each attempt to send
it to a replica a CLIENT span `upstream` below it, whose context goes down in the request's
`traceparent` (replacing the client's): the runtime's spans are its children. Retries on another
replica are further `upstream` spans; time held for a cold start is the gap before the first.

The hooks are installed only when tracing is on: a wrapper of the server's handler (`wrap`), which,
while a sampled request is handled, hands the upstream client (wire.py) what makes its `upstream` spans
(`wire.UPSTREAM_TRACE`), and a TraceConfig for the aiohttp session that asks every deployment's
replicas for `GET /v1/models` (`client_trace_config`, the same spans). Off, the proxy path runs no
tracing code at all. The setup (which exporters, the OTEL_* variables) is shared with the runtime
(`embedfleet.otel`), one home for both processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
from opentelemetry import context, propagate
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, get_current_span, set_span_in_context

from embedfleet.calls import Call, Handler, Reply, Stream
from embedfleet.gateway.wire import UPSTREAM_TRACE
from embedfleet.otel import TracingConfigError, exporters, provider_from_env

__all__ = ["OWN_PATHS", "GatewayTracing", "TracingConfigError", "exporters", "provider_from_env"]

OWN_PATHS = frozenset({"/health", "/ready", "/metrics", "/gateway/load"})  # polled; never traced


class UpstreamSpans:
    """The `upstream` CLIENT spans of the requests the upstream client sends (wire.UpstreamTrace): each
    started below the current span, injected as the request's `traceparent`, ended when the replica's
    answer begins (or the attempt fails)."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer

    def start(self, method: str, url: str, host: str, port: int, headers: dict[str, str]) -> object:
        span = self.tracer.start_span("upstream", kind=SpanKind.CLIENT, attributes={
            "http.request.method": method, "url.full": url, "server.address": host, "server.port": port})
        propagate.inject(headers, context=set_span_in_context(span))
        return span

    def end(self, span, status: int) -> None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def failed(self, span, error: BaseException) -> None:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.end()


class GatewayTracing:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("embedfleet.gateway")
        self.upstream = UpstreamSpans(self.tracer)

    def wrap(self, handler: Handler) -> Handler:
        """The handler with the SERVER span of every request but the gateway's own polled routes, current
        while the request is handled, and the upstream client's spans below it (`UPSTREAM_TRACE`)."""
        tracer = self.tracer
        upstream = self.upstream

        async def traced(call: Call) -> Reply | Stream:
            if call.path in OWN_PATHS:
                return await handler(call)
            span = tracer.start_span(call.method, context=propagate.extract(call.headers),
                                     kind=SpanKind.SERVER, attributes={"http.request.method": call.method,
                                                                       "url.path": call.path})
            if not span.is_recording():  # not sampled: the client's traceparent passes through as it came
                span.end()
                return await handler(call)
            token = context.attach(set_span_in_context(span))
            hook = UPSTREAM_TRACE.set(upstream)
            status = 500
            try:
                answer = await handler(call)
                status = answer.status
                return answer
            finally:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
                span.end()
                UPSTREAM_TRACE.reset(hook)
                context.detach(token)

        return traced

    def client_trace_config(self) -> aiohttp.TraceConfig:
        """The same `upstream` spans for an aiohttp session's requests made while a traced request is
        handled (the gateway's `GET /v1/models` to every deployment)."""
        tracer = self.tracer
        config = aiohttp.TraceConfig()

        async def start(session, ctx: SimpleNamespace, params: aiohttp.TraceRequestStartParams) -> None:
            ctx.span = None
            if not get_current_span().is_recording():
                return
            url = params.url
            span = tracer.start_span("upstream", kind=SpanKind.CLIENT, attributes={
                "http.request.method": params.method, "url.full": str(url.with_query(None)),
                "server.address": url.host or "", "server.port": url.port or 0})
            propagate.inject(params.headers, context=set_span_in_context(span))
            ctx.span = span

        async def end(session, ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams) -> None:
            if ctx.span is not None:
                ctx.span.set_attribute("http.response.status_code", params.response.status)
                if params.response.status >= 500:
                    ctx.span.set_status(Status(StatusCode.ERROR))
                ctx.span.end()

        async def failed(session, ctx: SimpleNamespace, params: aiohttp.TraceRequestExceptionParams) -> None:
            if ctx.span is not None:
                ctx.span.set_status(Status(StatusCode.ERROR, type(params.exception).__name__))
                ctx.span.end()

        config.on_request_start.append(start)
        config.on_request_end.append(end)
        config.on_request_exception.append(failed)
        return config

    def shutdown(self) -> None:
        """Export what is still buffered, then stop (at exit)."""
        self.provider.shutdown()
