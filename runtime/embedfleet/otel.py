"""OpenTelemetry set-up shared by the runtime and the gateway: which exporters run (the on/off rule) and
a TracerProvider configured by the standard OTEL_* variables (docs/tracing.md).

A module of the `embedfleet` namespace package of its own, outside `embedfleet.runtime`, because the
gateway ships and starts without the runtime (no torch, no FastAPI: tests/gateway/test_routing.py checks
it). It lives in the runtime's source folder only because a namespace module needs a folder.

A module of the small common package (the top-level ``embedfleet.*`` modules: otel, calls, httpserver,
compat, api_group), shared by components: it must import nothing from embedfleet.runtime, .operator,
.gateway or .client (tests/packaging/test_boundaries.py checks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the SDK (and psutil, which its resources import) loads only where tracing is on
    from opentelemetry.sdk.trace import TracerProvider

EXPORTERS = ("otlp", "console", "none")
_TRUE = frozenset({"1", "true", "yes", "on"})


class TracingConfigError(ValueError):
    """A tracing variable the SDK cannot act on; the message names it."""


def exporters(flag: bool, env: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters to run, () for tracing off. Pure: the whole on/off rule.

    Off unless `flag` (--otel / EMBEDFLEET_OTEL) or OTEL_TRACES_EXPORTER names an exporter;
    OTEL_SDK_DISABLED=true turns it off whatever else says. With the flag alone, OTLP (the SDK's default
    exporter). OTEL_TRACES_EXPORTER=none keeps it off even with the flag."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return ()
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not one of {', '.join(EXPORTERS)}")
    if not names:
        return ("otlp",) if flag else ()
    return tuple(n for n in names if n != "none")


def provider_from_env(service_name: str, names: Sequence[str]) -> TracerProvider:
    """A TracerProvider for `names` (from `exporters`), configured by the OTEL_* variables: the resource
    (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES; `service_name` when neither names the service), the
    sampler (OTEL_TRACES_SAMPLER[_ARG]), the OTLP/HTTP exporter (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT,
    _HEADERS, _TIMEOUT, ...) and the batch processor (OTEL_BSP_*), all read by the SDK itself."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # the SDK's stand-in
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter(service_name=service_name)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


