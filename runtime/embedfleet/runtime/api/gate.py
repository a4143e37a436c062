"""ASGI middleware in front of every route: auth, vector-space pinning (api/pinning.py), drain, payload
limit, admission, in-flight count.

Written as raw ASGI (not BaseHTTPMiddleware) because it runs on every request and must add
microseconds, not milliseconds, to the single-query fast path.

Every answer to admitted work carries the replica's load, so a gateway in front of several replicas
picks the least loaded one from the answers it already reads, without scraping: the expected queue
wait (`x-embedfleet-expected-wait`, seconds) and the server's own time for the request
(`server-timing: total;dur=<ms>`, the standard header, which also tells a load test how much of its
latency was the server's), with the parts of that time (timing.py: tokenization, queue, inference, also
as TEI's `x-*-time` headers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from starlette.exceptions import HTTPException as StarletteHTTPException

from embedfleet.runtime.api.errors import error_body
from embedfleet.runtime.api.pinning import MISMATCH, VECTOR_SPACE_HEADER, Pinning
from embedfleet.runtime.metrics import MULTIPROCESS, RuntimeMetrics
from embedfleet.runtime.tenants import Tenant, Tenants
from embedfleet.runtime.timing import RequestTiming
from embedfleet.runtime.tracing import RuntimeTracing

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/load"})
ARRIVED = "embedfleet.arrived"  # scope key: time.monotonic() when the gate let the request in (deadlines count from it)
WHOLE = "embedfleet.whole"  # scope key: time.monotonic() when its body was all read (queue bounds count from it)
TENANT = "embedfleet.tenant"  # scope key: the caller's tenants.Tenant, from its API key


class PayloadTooLarge(StarletteHTTPException):
    """An HTTPException so that FastAPI's body parsing passes it through as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the payload limit of {limit} bytes")


@dataclass
class GateState:
    """Shared with the server: the drain flag and the count the autoscaler reads."""

    draining: bool = False
    in_flight: int = 0
    tracing: RuntimeTracing | None = None  # --otel (tracing.py); None: no span, no propagation work
    pinning: Pinning = field(default_factory=Pinning)  # the vector space served (api/pinning.py)


class Gate:
    def __init__(self, app, *, tenants: Tenants, payload_limit: int, max_concurrent: int,
                 state: GateState, metrics: RuntimeMetrics, queue_saturated, known_paths: frozenset[str],
                 refusing_all: Callable[[], int | None] = lambda: None,
                 expected_wait: Callable[[], float] = lambda: 0.0, count: bool = True) -> None:
        self.app = app
        self.tenants = tenants
        self.payload_limit = payload_limit
        self.max_concurrent = max_concurrent
        self.state = state
        self.metrics = metrics
        self.queue_saturated = queue_saturated
        self.known_paths = known_paths
        self.refusing_all = refusing_all
        self.expected_wait = expected_wait
        # read when scraped; with several processes (split/) each keeps its own count up to date instead, and
        # the engine process (`count` false) counts none: the requests it gets were counted by a front
        self.count = count
        self._in_flight = metrics.requests_in_flight if MULTIPROCESS and count else None
        if not MULTIPROCESS:
            metrics.requests_in_flight.set_function(lambda: state.in_flight)
        self._duration = cache(metrics.request_duration.labels)  # by route: looked up once each
        self._cold_start = metrics.cold_start  # told of the first 2xx answer (cold_start.py first_request)

    async def _refuse(self, send, status: int, message: str, code: str,
                      extra: list[tuple[bytes, bytes]] | None = None, kind: str | None = None) -> None:
        self.metrics.errors.labels(str(status)).inc()
        body = error_body(status, message, code, kind)
        # The request body is left unread, so the connection is closed after this answer: a client that
        # reused it for its next request could otherwise race the server's close and see a reset.
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or is_startup_probe(scope):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        tenant = self.tenants.identify(headers.get(b"authorization"))
        if tenant is None:
            await self._refuse(send, 401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                               "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        scope[TENANT] = tenant
        pinning = self.state.pinning
        wanted = headers.get(VECTOR_SPACE_HEADER)
        if wanted is not None and pinning.refuses(wanted):  # before the body is read: no engine work
            await self._refuse(send, 409, pinning.mismatch_message(wanted), MISMATCH, pinning.headers, MISMATCH)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, self._stamped(send, pinning.headers) if pinning.headers else send)
            return
        if self.state.draining:
            await self._refuse(send, 503, "the server is draining for shutdown; retry on another replica",
                               "draining", [(b"retry-after", b"1")])
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.payload_limit:
            await self._refuse(send, 413, f"request body of {int(length)} bytes is over the payload limit of "
                               f"{self.payload_limit} bytes", "payload_too_large")
            return
        if self.state.in_flight >= self.max_concurrent or self.queue_saturated():
            await self._refuse(send, 429, f"the server is at capacity ({self.state.in_flight} requests in "
                               f"flight, limit {self.max_concurrent}); retry later", "overloaded",
                               [(b"retry-after", b"1")])
            return
        retry = self.refusing_all()
        if retry is not None:  # the same answer admission would give after parsing and tokenizing
            self.metrics.shed.labels("*", "expected_wait").inc()  # "*": refused for every model at once
            await self._refuse(send, 429, "the server is overloaded: the work already queued is past both "
                               "--max-queue-seconds and --max-queue-seconds-bulk at the measured speed; retry "
                               f"in {retry}s", "overloaded", [(b"retry-after", str(retry).encode())])
            return
        await self._admit(scope, receive, send)

    @staticmethod
    def _stamped(send, headers: list[tuple[bytes, bytes]]):
        """`send` that names the revision and vector space on the response (GET routes)."""
        async def stamped(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *headers]
            await send(message)
        return stamped

    async def _admit(self, scope, receive, send) -> None:
        received = 0
        started_response = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.payload_limit:
                    raise PayloadTooLarge(self.payload_limit)
                if not message.get("more_body", False):
                    # the request is whole only now: its queue bounds count from here (a slow upload is
                    # the client's time, not the queue's); its deadline still counts from its head
                    scope[WHOLE] = time.monotonic()
            return message

        async def tracked_send(message):
            nonlocal started_response
            if message["type"] == "http.response.start":
                started_response = True
                if self._cold_start.waiting and message["status"] < 300:
                    self._cold_start.answered()
                if trace is not None:
                    trace.responded(message["status"])
                took = (time.monotonic() - arrived) * 1000
                message["headers"] = [*message.get("headers", ()),
                                      (b"x-embedfleet-expected-wait", b"%.4f" % self.expected_wait()),
                                      *timing.headers(took), *self.state.pinning.headers]
            await send(message)

        scope[ARRIVED] = arrived = time.monotonic()
        trace = None if self.state.tracing is None or not self.count else self.state.tracing.begin(
            scope, scope["path"] if scope["path"] in self.known_paths else "other", scope[TENANT].name)
        timing = RequestTiming().begin()
        self.state.in_flight += 1
        if self._in_flight is not None:
            self._in_flight.inc()
        start = time.perf_counter()
        try:
            await self.app(scope, counted_receive, tracked_send)
        except PayloadTooLarge:
            if not started_response:
                await self._refuse(send, 413, f"request body is over the payload limit of {self.payload_limit} "
                                   "bytes", "payload_too_large")
        finally:
            timing.end()
            if trace is not None:
                trace.end()
            self.state.in_flight -= 1
            if self._in_flight is not None:
                self._in_flight.dec()
            if self.count:
                route = scope["path"] if scope["path"] in self.known_paths else "other"
                self._duration(route).observe(time.perf_counter() - start)


def is_startup_probe(scope) -> bool:
    """GET /v1/models/MODEL/probe with no query: a model's start-up probe outputs, served from memory.
    Open like /metrics (which already names the fingerprint): the operator's drift gate reads it from pod
    IPs with no API key. `?fresh=1` runs the engine, so it goes through the gate like any request."""
    path = scope["path"]
    return (scope["method"] == "GET" and not scope["query_string"] and path.startswith("/v1/models/")
            and path.endswith("/probe"))


def tenant_of(scope) -> Tenant:
    """The tenant the gate identified (routes behind the gate always have one)."""
    return scope[TENANT]
