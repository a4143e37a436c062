"""OpenTelemetry tracing (docs/tracing.md): span structure and parentage across gateway and runtime,
nothing when off, and a real OTLP/HTTP export from `embedfleet serve` to a collector.

The span-structure test needs the SDK's in-memory exporter, which lives in this process, so there the
runtime and the gateway are this checkout's real apps served in-process on real loopback sockets
(uvicorn.Server on a thread; the gateway's server, calls.py on httpserver.py, on an event loop of its own
thread), wired as
`embedfleet serve` and `embedfleet gateway --otel` wire them, with a TracerProvider carrying the
in-memory exporter. Requests go over real sockets, and the gateway reaches the runtime over one, so
`traceparent` crosses a real HTTP hop. The export tests start real `embedfleet serve` processes.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import random
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from embedfleet.calls import CallApp
from embedfleet.gateway.config import GatewayConfig
from embedfleet.gateway.fleet import Fleet
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.gateway.proxy import Gateway
from embedfleet.gateway.tracing import GatewayTracing
from embedfleet.httpserver import Limits, server
from embedfleet.otel import TracingConfigError, exporters
from embedfleet.runtime.api.app import create_app
from embedfleet.runtime.api.gate import GateState
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.service import Models
from embedfleet.runtime.settings import RuntimeSettings
from embedfleet.runtime.tracing import RuntimeTracing
from tests.procs import ROOT, RuntimeServer, child_env, free_port, spawn, wait_url_ready

MODEL = "all-MiniLM-L6-v2"
KEY = "sk-tracing-secret-key"
TEXTS = ["a private sentence about tracing", "another private text"]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
RUNTIME_SPANS = ("validation", "tokenization", "queue wait", "engine batch", "encode")


def wait_until(check, what: str, within: float = 60.0):
    """Poll `check` until it returns something truthy (and return it)."""
    deadline = time.monotonic() + within
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        time.sleep(0.05)


# -- in-process servers on real sockets --------------------------------------------------------------

class InProcessRuntime:
    """The runtime app exactly as serve.py builds it, served by uvicorn on a thread."""

    def __init__(self, tracing: RuntimeTracing | None) -> None:
        self.port = free_port()
        settings = RuntimeSettings(host="127.0.0.1", port=self.port, api_key=KEY, max_batch_requests=8)
        app = create_app(Models(settings, RuntimeMetrics()), GateState(tracing=tracing))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="runtime", daemon=True)
        self.thread.start()
        if not wait_url_ready(self.url, timeout=120):
            raise TimeoutError("in-process runtime not ready")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class InProcessGateway:
    """The gateway as `embedfleet gateway` builds it (cli.serve), on an event loop of its own thread."""

    def __init__(self, upstream: str, tracing: GatewayTracing | None) -> None:
        self.port = free_port()
        self.config = GatewayConfig(upstreams={MODEL: [upstream]}, host="127.0.0.1", port=self.port)
        self.tracing = tracing
        self.loop = asyncio.new_event_loop()
        self.stopped = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)
        self.thread.start()
        if not wait_url_ready(self.url, timeout=60):
            raise TimeoutError("in-process gateway not ready")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        tracing = self.tracing
        work = aiohttp.ClientSession(auto_decompress=False,
                                     trace_configs=None if tracing is None else [tracing.client_trace_config()])
        polls = aiohttp.ClientSession()
        rng = random.Random(0)
        fleet = Fleet(self.config, polls, rng)
        gateway = Gateway(self.config, fleet, GatewayMetrics(fleet.snapshot, fleet.replica_waits), work, rng)
        app = CallApp(gateway.handle if tracing is None else tracing.wrap(gateway.handle), self.config.payload_limit)
        http = server(app, "127.0.0.1", self.port, Limits())
        poller = asyncio.create_task(fleet.upstreams.run())
        await http.startup()
        await self.stopped.wait()
        poller.cancel()
        await http.shutdown()
        await work.close()
        await polls.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopped.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def provider(spans: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider


@pytest.fixture(scope="module")
def runtime(provider: TracerProvider):
    srv = InProcessRuntime(RuntimeTracing(provider))
    yield srv
    srv.stop()


def embed_through(url: str, headers: dict[str, str]) -> None:
    r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": TEXTS},
                   headers={"authorization": f"Bearer {KEY}", **headers}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == len(TEXTS)


def trace_of(spans: InMemorySpanExporter, trace_id: int) -> list:
    return [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]


def complete(found: list, gateway_spans: int) -> bool:
    names = [s.name for s in found]
    return all(n in names for n in RUNTIME_SPANS) and sum(
        s.instrumentation_scope.name == "embedfleet.gateway" for s in found) >= gateway_spans


# -- structure ---------------------------------------------------------------------------------------

def test_gateway_and_runtime_spans_form_one_trace(runtime: InProcessRuntime, provider: TracerProvider,
                                                   spans: InMemorySpanExporter) -> None:
    gateway = InProcessGateway(runtime.url, GatewayTracing(provider))
    try:
        embed_through(gateway.url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    finally:
        gateway.stop()
    trace_id = int(CLIENT_TRACE, 16)
    found = wait_until(lambda: (f := trace_of(spans, trace_id)) and complete(f, 2) and f, "the whole trace")
    by_name = {s.name: s for s in found}

    # the gateway continues the client's trace, and its upstream span is what it sends down
    server = next(s for s in found
                  if s.kind == SpanKind.SERVER and s.instrumentation_scope.name == "embedfleet.gateway")
    assert server.parent.span_id == int(CLIENT_SPAN, 16)
    upstream = by_name["upstream"]
    assert upstream.kind == SpanKind.CLIENT and upstream.parent.span_id == server.context.span_id
    assert upstream.attributes["http.response.status_code"] == 200
    assert upstream.attributes["server.port"] == runtime.port

    # the runtime's gate span is the child of the gateway's upstream span, across the socket
    gate = by_name["POST /v1/embeddings"]
    assert gate.kind == SpanKind.SERVER and gate.instrumentation_scope.name == "embedfleet.runtime"
    assert gate.parent.span_id == upstream.context.span_id
    assert gate.attributes["http.route"] == "/v1/embeddings"
    assert gate.attributes["http.response.status_code"] == 200
    assert gate.attributes["embedfleet.model"] == MODEL
    assert gate.attributes["embedfleet.tenant"] == "default"

    # its phases are its children, one after the other
    phases = [by_name[name] for name in RUNTIME_SPANS]
    assert all(p.parent.span_id == gate.context.span_id for p in phases)
    for before, after in itertools.pairwise(phases):
        assert before.end_time <= after.start_time, (before.name, after.name)
    assert gate.start_time <= phases[0].start_time and phases[-1].end_time <= gate.end_time
    tokenization = by_name["tokenization"]
    assert tokenization.attributes["embedfleet.inputs"] == len(TEXTS)
    assert tokenization.attributes["embedfleet.tokens"] >= len(TEXTS) * 3  # [CLS] word(s) [SEP] at least
    assert by_name["queue wait"].attributes["embedfleet.tokens"] == tokenization.attributes["embedfleet.tokens"]

    # the engine batch: the request's share below it, the batch's own span linked to the request
    share = by_name["engine batch"]
    assert share.attributes["embedfleet.inputs"] == len(TEXTS)
    assert share.attributes["embedfleet.batch.size"] >= len(TEXTS)
    batch_ids = {link.context.span_id for link in share.links}
    batch = wait_until(lambda: next((s for s in spans.get_finished_spans() if s.name == "batch"
                                     and s.context.span_id in batch_ids), None), "the batch span")
    assert batch.context.trace_id != trace_id and batch.parent is None  # its own trace
    assert (trace_id, gate.context.span_id) in {(link.context.trace_id, link.context.span_id)
                                                for link in batch.links}
    assert batch.attributes["embedfleet.batch.tokens"] == share.attributes["embedfleet.batch.tokens"]

    # no input text and no API key in any attribute
    values = " ".join(str(v) for s in [*found, batch] for v in s.attributes.values())
    assert KEY not in values and not any(text in values for text in TEXTS)


def test_gateway_without_tracing_passes_the_clients_traceparent(runtime: InProcessRuntime,
                                                                spans: InMemorySpanExporter) -> None:
    """Off, the gateway makes no span and the client's traceparent reaches the runtime as it was sent."""
    trace = "0af7651916cd43dd8448eb211c80319c"
    gateway = InProcessGateway(runtime.url, None)
    try:
        embed_through(gateway.url, {"traceparent": f"00-{trace}-b7ad6b7169203331-01"})
    finally:
        gateway.stop()
    found = wait_until(lambda: (f := trace_of(spans, int(trace, 16))) and complete(f, 0) and f, "the runtime's spans")
    assert not [s for s in found if s.instrumentation_scope.name == "embedfleet.gateway"]
    gate = next(s for s in found if s.name == "POST /v1/embeddings")
    assert gate.parent.span_id == int("b7ad6b7169203331", 16)


def test_refused_request_marks_the_phase_that_refused(runtime: InProcessRuntime, spans: InMemorySpanExporter) -> None:
    trace = "1af7651916cd43dd8448eb211c80319d"
    r = httpx.post(f"{runtime.url}/v1/embeddings", json={"model": "no-such-model", "input": "x"},
                   headers={"authorization": f"Bearer {KEY}", "traceparent": f"00-{trace}-b7ad6b7169203332-01"})
    assert r.status_code == 404
    found = wait_until(lambda: (f := trace_of(spans, int(trace, 16))) and len(f) >= 2 and f, "the refused request")
    gate = next(s for s in found if s.name == "POST /v1/embeddings")
    assert gate.attributes["http.response.status_code"] == 404
    validation = next(s for s in found if s.name == "validation")
    assert not validation.status.is_ok and "404" in validation.status.description
    assert not [s for s in found if s.name in ("tokenization", "queue wait", "engine batch", "encode")]


def test_tracing_off_makes_no_spans(spans: InMemorySpanExporter) -> None:
    """A runtime built without tracing (the default) makes no span even when the caller sends a
    traceparent; the in-memory exporter next door, which every traced app here writes to, gets nothing."""
    srv = InProcessRuntime(None)
    try:
        before = len(spans.get_finished_spans())
        for _ in range(3):
            embed_through(srv.url, {"traceparent": f"00-{CLIENT_TRACE[::-1]}-{CLIENT_SPAN}-01"})
        time.sleep(0.2)  # a batch's spans are made just after its answers go out
        assert len(spans.get_finished_spans()) == before
    finally:
        srv.stop()


# -- the on/off rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("flag", "env", "expected"), [
    (False, {}, ()),
    (False, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),  # an endpoint alone does not turn it on
    (True, {}, ("otlp",)),
    (False, {"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
    (False, {"OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp", "console")),
    (True, {"OTEL_TRACES_EXPORTER": "none"}, ()),
    (True, {"OTEL_SDK_DISABLED": "true"}, ()),
    (False, {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}, ()),
])
def test_exporters_rule(flag: bool, env: dict[str, str], expected: tuple[str, ...]) -> None:
    assert exporters(flag, env) == expected


def test_unknown_exporter_is_named() -> None:
    with pytest.raises(TracingConfigError, match="jaeger"):
        exporters(True, {"OTEL_TRACES_EXPORTER": "jaeger"})


def test_unknown_exporter_stops_serve_naming_it() -> None:
    done = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=child_env({"OTEL_TRACES_EXPORTER": "jaeger", "OTEL_SDK_DISABLED": None}))
    assert done.returncode == 2
    assert "OTEL_TRACES_EXPORTER" in done.stderr and "jaeger" in done.stderr


# -- a real OTLP/HTTP export -------------------------------------------------------------------------

class Collector:
    """A tiny OTLP/HTTP traces endpoint: POST /v1/traces, protobuf decoded with opentelemetry-proto."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.posts = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    raw = gzip.decompress(raw)
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(raw)
                collector.posts += 1
                for resource_spans in request.resource_spans:
                    resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            collector.spans.append({
                                "resource": resource, "name": span.name, "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                                "attributes": {kv.key: kv.value for kv in span.attributes}})
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.stop()


def otel_env(collector: Collector, **extra: str | None) -> dict[str, str | None]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_TRACES_EXPORTER": None, "OTEL_SDK_DISABLED": None, "EMBEDFLEET_OTEL": None,
            "OTEL_SERVICE_NAME": None, "OTEL_RESOURCE_ATTRIBUTES": None, **extra}


def test_serve_exports_over_otlp_http_when_enabled_by_otel_variables(runtime_factory, collector: Collector) -> None:
    """Spans buffered (a minute's batch delay) when the server is stopped reach the collector at shutdown."""
    trace = "5bf92f3577b34da6a3ce929d0e0e4737"
    srv = runtime_factory(env=otel_env(collector, OTEL_TRACES_EXPORTER="otlp", OTEL_SERVICE_NAME="embed-test",
                                       OTEL_RESOURCE_ATTRIBUTES="deployment.environment=ci",
                                       OTEL_BSP_SCHEDULE_DELAY="60000"))
    r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS},
                   headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}, timeout=120)
    assert r.status_code == 200, r.text
    srv.stop()
    names = lambda: {s["name"] for s in collector.spans if s["trace_id"] == trace}  # noqa: E731
    wait_until(lambda: set(RUNTIME_SPANS) <= names(), "the request's spans at the collector")
    mine = [s for s in collector.spans if s["trace_id"] == trace]
    gate = next(s for s in mine if s["name"] == "POST /v1/embeddings")
    assert gate["parent"] == CLIENT_SPAN
    assert gate["resource"]["service.name"] == "embed-test"
    assert gate["resource"]["deployment.environment"] == "ci"
    assert gate["attributes"]["embedfleet.model"].string_value == MODEL
    assert all(s["parent"] == gate["span_id"] for s in mine if s["name"] in RUNTIME_SPANS)


def test_a_split_server_exports_one_trace_across_its_processes(runtime_factory, collector: Collector) -> None:
    """`serve --fronts 1 --otel`: the front makes the request's spans up to tokenization and the encode, the
    engine process the queue wait and the engine batch (a front has no batcher); both export, and the
    trace has the single process's shape: every phase a child of the front's server span."""
    trace = "7bf92f3577b34da6a3ce929d0e0e4739"
    srv = runtime_factory("--fronts", "1", "--otel", env=otel_env(collector))
    r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS},
                   headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}, timeout=120)
    assert r.status_code == 200, r.text
    mine = lambda: [s for s in collector.spans if s["trace_id"] == trace]  # noqa: E731
    wait_until(lambda: set(RUNTIME_SPANS) <= {s["name"] for s in mine()}, "the spans of both processes")
    gate = next(s for s in mine() if s["name"] == "POST /v1/embeddings")
    assert gate["parent"] == CLIENT_SPAN
    assert gate["attributes"]["embedfleet.inputs"].int_value == len(TEXTS)
    assert all(s["parent"] == gate["span_id"] for s in mine() if s["name"] in RUNTIME_SPANS), mine()
    # the engine's own span of the batch (a trace of its own) links back to the request
    batch = [s for s in collector.spans if s["name"] == "batch"]
    assert batch and all(s["trace_id"] != trace for s in batch)
    assert {s["attributes"]["embedfleet.model"].string_value for s in batch} == {MODEL}
    untraced = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS},
                          headers={"traceparent": f"00-{trace[::-1]}-{CLIENT_SPAN}-00"}, timeout=120)
    assert untraced.status_code == 200
    srv.stop()
    assert not [s for s in collector.spans if s["trace_id"] == trace[::-1]], "an unsampled request was traced"


def test_serve_exports_nothing_by_default(runtime_factory, collector: Collector) -> None:
    """The OTLP endpoint set, tracing not asked for: after requests and a clean shutdown (which would
    flush any buffered span), the collector has received nothing."""
    srv = runtime_factory(env=otel_env(collector))
    for _ in range(3):
        r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": TEXTS},
                       headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, timeout=120)
        assert r.status_code == 200
    srv.stop()
    assert collector.posts == 0 and collector.spans == []


def test_gateway_and_serve_processes_export_one_trace(runtime_factory, collector: Collector) -> None:
    """`embedfleet gateway --otel` in front of `embedfleet serve --otel`, both exporting to the collector:
    the runtime's spans continue the gateway's trace across the processes."""
    env = otel_env(collector)
    runtime = runtime_factory("--otel", env=env)
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="embedfleet-gateway-", suffix=".log", delete=False)
    proc = spawn([sys.executable, "-m", "embedfleet.runtime.cli", "gateway", "--otel", "--host", "127.0.0.1",
                  "--port", str(port), "--upstream", f"{MODEL}={runtime.url}"],
                 stdout=log, stderr=subprocess.STDOUT, env=child_env(env), cwd=ROOT)
    gateway = RuntimeServer(proc, port, Path(log.name))
    try:
        gateway.wait_ready(timeout=60)
        trace = "6bf92f3577b34da6a3ce929d0e0e4738"
        r = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": TEXTS},
                       headers={"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}, timeout=120)
        assert r.status_code == 200, r.text
        mine = lambda: [s for s in collector.spans if s["trace_id"] == trace]  # noqa: E731
        wait_until(lambda: {"upstream", "encode"} <= {s["name"] for s in mine()}, "both processes' spans")
    finally:
        gateway.stop()
    spans = {s["name"]: s for s in mine()}
    server = spans["POST"]
    assert server["resource"]["service.name"] == "embedfleet-gateway" and server["parent"] == CLIENT_SPAN
    assert spans["upstream"]["parent"] == server["span_id"]
    gate = spans["POST /v1/embeddings"]
    assert gate["resource"]["service.name"] == "embedfleet-runtime"
    assert gate["parent"] == spans["upstream"]["span_id"]
    assert spans["encode"]["parent"] == gate["span_id"]
