"""OpenTelemetry tracing of the gateway's proxying, off unless asked for (docs/tracing.md).

On (--otel, EMBEDFLEET_OTEL, or OTEL_TRACES_EXPORTER naming an exporter), each work request gets a
SERVER span that starts or continues the client's trace (W3C `traceparent`), and each attempt to send
it to a replica a CLIENT span `upstream` below it, whose context goes down in the request's
`traceparent` (replacing the client's): the runtime's spans are its children. Retries on another
replica are further `upstream` spans; time held for a cold start is the gap before the first.

Both hooks are installed only when tracing is on: a wrapper of the server's handler (`wrap`) and a
TraceConfig on the work session (`client_trace_config`), so off, the proxy path runs no tracing code at
all. The setup (which exporters, the OTEL_* variables) is shared with the runtime (`embedfleet.otel`),
one home for both processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
from opentelemetry import context, propagate
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, get_current_span, set_span_in_context

from embedfleet.calls import Call, Handler, Reply, Stream
from embedfleet.otel import TracingConfigError, exporters, provider_from_env

__all__ = ["OWN_PATHS", "GatewayTracing", "TracingConfigError", "exporters", "provider_from_env"]

OWN_PATHS = frozenset({"/health", "/ready", "/metrics", "/gateway/load"})  # polled; never traced


class GatewayTracing:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("embedfleet.gateway")

    def wrap(self, handler: Handler) -> Handler:
        """The handler with the SERVER span of every request but the gateway's own polled routes, current
        while the request is handled, so that `client_trace_config` finds it."""
        tracer = self.tracer

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
                context.detach(token)

        return traced

    def client_trace_config(self) -> aiohttp.TraceConfig:
        """An `upstream` CLIENT span per request sent to a replica while a traced request is handled,
        injected as the upstream request's `traceparent`; it ends when the replica's answer begins."""
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
