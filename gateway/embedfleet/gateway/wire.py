"""The gateway's HTTP/1.1 client to the replicas (and to other regions' gateways): keep-alive
connections, httptools to parse. All of the gateway's work goes through it.

Why not aiohttp's client, which the gateway keeps for its polls: on the hop to a replica it was most
of the gateway's cost. The hop runs once per request after the gateway has slept through the
replica's forward pass, on cold caches, where every layer of a general client (timers, tracing hooks,
cookie jar, header normalisation, streams) costs many times its warm price (bench/gateway_upstream.py,
docs/gateway.md). And it is held to the same fault and abuse cases aiohttp's client was
(tests/gateway/test_upstream_faults.py).

So this client does only what the hop needs: one request at a time per connection (no pipelining),
bodies sent whole with a Content-Length, answers parsed by httptools (the C parser uvicorn uses),
passed on whole when short or streamed chunk by chunk (with back-pressure) when long or chunked; an
answer's head is bounded (MAX_HEAD). https targets get TLS (`tls`: the system's CAs by default). While
a traced request is handled, `UPSTREAM_TRACE` holds what makes each attempt's CLIENT span and its
`traceparent` (tracing.py); otherwise no tracing code runs.

Failures are told apart the way the proxy needs them (a replica that never saw the request is tried
again; one that may have run it never is): `ConnectFailed` (refused, unreachable, a TLS handshake
refused, or not accepted within the connect timeout), `Disconnected` (closed or reset before any byte
of an answer: most often a kept-alive connection the replica had just closed), `BadAnswer` (not HTTP,
or a head past MAX_HEAD), `BrokeOff` (the answer stopped part way), TimeoutError (no answer within the
request's total time).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Protocol
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

log = logging.getLogger("embedfleet.gateway.wire")

PAUSE_ABOVE = 1 << 20  # bytes of a streamed answer buffered before reading from the replica pauses
MAX_HEAD = 64 << 10  # bytes of an answer's head at most (status line and headers); beyond, a BadAnswer
MAX_IDLE_PER_HOST = 128  # idle keep-alive connections kept per replica; more are closed when released
DEAD_AFTER_S = 4  # a replica whose kernel answers no TCP keepalive probe for this long is lost; 0: never probed
MAX_PROBES = 127  # Linux's bound on TCP_KEEPCNT
# a connection that ends with one of these was not closed by the replica: its host went silent or away
LOST_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN})
LAST_ACK_RECV_AT = 56  # offset of tcpi_last_ack_recv (milliseconds) in Linux's struct tcp_info
# a connection whose kernel heard from the peer this recently is alive whatever another one found: with
# keepalive a live peer answers a probe every second or so, a silent one nothing
SILENT_S = 1.5


class UpstreamTrace(Protocol):
    """What traces the requests sent (tracing.py): `start` may add headers (`traceparent`) and returns a
    handle that `end` (the answer's head is in) or `failed` (no answer) is then given once."""

    def start(self, method: str, url: str, host: str, port: int, headers: dict[str, str]) -> object: ...

    def end(self, handle: object, status: int) -> None: ...

    def failed(self, handle: object, error: BaseException) -> None: ...


# set, while a traced request is handled, by the tracing wrapper of the server's handler (tracing.py);
# None (tracing off, or the request not sampled): no tracing code runs here
UPSTREAM_TRACE: ContextVar[UpstreamTrace | None] = ContextVar("embedfleet_upstream_trace", default=None)


class WireError(Exception):
    """Base of the client's own failures."""


class ConnectFailed(WireError):
    """No connection: the replica never saw the request."""


class Disconnected(WireError):
    """The connection closed before any byte of an answer."""


class Lost(Disconnected):
    """Before any byte of an answer, the replica's host stopped answering at the TCP level (keepalive
    probes unanswered, or no route to it any more): the request may have run there, but no answer will
    ever come from it. Every request in flight to that replica without an answer byte ends so at once."""


def is_lost(exc: BaseException | None) -> bool:
    """Did a connection end because its peer went silent or unreachable (not closed by the peer)?"""
    return isinstance(exc, OSError) and exc.errno in LOST_ERRNOS


def keep_probing(transport: asyncio.BaseTransport, dead_after_s: int) -> None:
    """TCP keepalive on an upstream connection: after a second without traffic the kernel probes the peer
    every second, and ends the connection with ETIMEDOUT when `dead_after_s` seconds pass unanswered. A
    live replica's kernel answers the probes however busy its process is, so only a silent host (a node
    lost, its network cut) is found dead. Unacknowledged data (a request sent just as the host went
    silent) is not probed: `_HostPool.lost` ends those connections when another is found lost or the
    replica's poll fails. Where the options are missing (not Linux) or refused, nothing is probed."""
    sock = transport.get_extra_info("socket")
    if not dead_after_s or sock is None or not hasattr(socket, "TCP_KEEPIDLE"):
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, min(MAX_PROBES, dead_after_s - 1)))
    except OSError as exc:
        log.warning("TCP keepalive refused on a connection to %s: %s", transport.get_extra_info("peername"), exc)


def silent_s(transport: asyncio.BaseTransport | None) -> float | None:
    """Seconds since the kernel last received an acknowledgement on this connection (TCP_INFO's
    last_ack_recv: keepalive probes' answers count), or None where that cannot be read."""
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    return struct.unpack_from("I", info, LAST_ACK_RECV_AT)[0] / 1000 if len(info) >= LAST_ACK_RECV_AT + 4 else None


class BadAnswer(WireError):
    """The replica's bytes are not an HTTP answer."""


class BrokeOff(WireError):
    """The answer stopped before its end."""


class Answer:
    """One answer: status, reason and headers at once; the body by `read()` (whole) or `iter_any()`.
    Use as an async context manager: leaving it returns the connection for reuse when the answer was
    read to its end and the replica keeps the connection alive, and closes it otherwise."""

    def __init__(self, conn: _Connection, deadline: float | None) -> None:
        self._conn = conn
        self._deadline = deadline  # loop time; None: no limit
        self.status = 0
        self.reason = ""
        self.raw_headers: list[tuple[bytes, bytes]] = []  # as they came, for passing on without decoding
        self._headers: CIMultiDict[str] | None = None
        self._chunked = False
        self.content_length: int | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._wake: asyncio.Future[None] | None = None
        self.on_complete: Callable[[Answer], object] | None = None  # called once the whole answer is here
        self.delivered: object = None  # what `on_complete` returned

    @property
    def headers(self) -> CIMultiDict[str]:
        """The head's headers, decoded when first asked for."""
        if self._headers is None:
            self._headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers)
        return self._headers

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._conn.finished(self, reusable=self._complete and self._error is None)

    async def read(self) -> bytes:
        """The whole body."""
        if self._complete and self._error is None:  # the usual short answer: all here with its head
            return self.body_now()
        return b"".join([chunk async for chunk in self.iter_any()])

    def body_now(self) -> bytes:
        """The whole body of a complete answer, at once."""
        parts, self._chunks, self._buffered = list(self._chunks), collections.deque(), 0
        self._conn.resume()
        return b"".join(parts)

    async def iter_any(self):
        """The body's bytes as they come (chunked transfer coding already removed)."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._buffered <= PAUSE_ABOVE:
                    self._conn.resume()
                yield chunk
                continue
            if self._error is not None:
                raise self._error
            if self._complete:
                return
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await _within(self._wake, self._deadline)
            finally:
                self._wake = None

    # -- fed by the connection

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_ABOVE:
            self._conn.pause()
        self._poke()

    def _end(self, error: BaseException | None) -> None:
        if error is None:
            self._complete = True
        elif not self._complete:
            self._error = error
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)


async def _within(future: asyncio.Future[None], deadline: float | None) -> None:
    """Wait for `future` until `deadline` (loop time; None: no limit, and no timer made for it)."""
    if deadline is None:
        await future
        return
    async with asyncio.timeout_at(deadline):
        await future


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one replica, carrying one request at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.answer: Answer | None = None
        self.head: asyncio.Future[None] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._reason = ""
        self._got_bytes = False
        self._head_bytes = 0  # bytes received while the answer's head is incomplete
        self._head_only = False
        self._paused = False
        self.keep_alive = False  # the answer's head allows reuse (known only while the head is parsed)
        self.forgotten = False  # no longer counted among its pool's open connections
        self.given_up: str | None = None  # why its pool gave it up (another connection found its host lost)

    def start(self, answer: Answer, data: bytes, head_only: bool = False) -> asyncio.Future[None]:
        self.answer, self._headers, self._reason, self._got_bytes, self.keep_alive = answer, [], "", False, False
        self._head_only = head_only  # a HEAD request: the answer ends with its head
        self._head_bytes = 0
        self.head = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.pool.busy.add(self)
        self.transport.write(data)
        return self.head

    def finished(self, answer: Answer, reusable: bool) -> None:
        if self.answer is not answer:
            return
        self.answer, self.head = None, None
        self.pool.busy.discard(self)
        if reusable and not self.closed and self.keep_alive:
            self.pool.release(self)
        else:
            self.close()
            self.pool.forget(self)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadAnswer(f"not an HTTP answer: {exc}"))
            self.close()
            return
        if self.head is not None and not self.head.done():  # httptools bounds no head: this does
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._fail(BadAnswer(f"an answer's head over {MAX_HEAD} bytes"))
                self.close()

    def eof_received(self) -> bool:
        return False  # close; connection_lost reports it

    def give_up(self, why: str) -> None:
        """End the connection at once: its host was found lost on another connection."""
        self.given_up = why
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.busy.discard(self)
        answer = self.answer
        lost = is_lost(exc)
        if lost:
            self.pool.lost(f"another connection to {self.pool.host}:{self.pool.port} ended: {exc}")
        if answer is not None:
            if not self._got_bytes and (lost or self.given_up):
                self._fail(Lost(f"the replica went silent before answering ({self.given_up or exc})"))
            elif not self._got_bytes:
                self._fail(Disconnected(f"closed before answering{f': {exc}' if exc else ''}"))
            elif (exc is None and self.head is not None and self.head.done() and answer.content_length is None
                  and not answer._chunked):
                answer._end(None)  # a body without a length ends where the connection does
            else:
                self._fail(BrokeOff(f"the answer broke off{f': {exc}' if exc else ''}"))
        self.pool.forget(self)

    def _fail(self, error: WireError) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        elif self.answer is not None:
            self.answer._end(error)

    # -- httptools callbacks

    def on_status(self, status: bytes) -> None:
        self._reason += status.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        answer = self.answer
        if answer is None or self.head is None:
            return
        self.keep_alive = self.parser.should_keep_alive()
        answer.status = self.parser.get_status_code()
        answer.reason = self._reason
        answer.raw_headers = self._headers
        length = None
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length":
                length = value
            elif lower == b"transfer-encoding":
                answer._chunked = b"chunked" in value.lower()
        if length is not None and length.isdigit() and not answer._chunked:
            answer.content_length = int(length)
        if not self.head.done():
            self.head.set_result(None)
        if self._head_only:  # httptools would wait for the body a GET would get: end here, and never reuse
            self.keep_alive = False
            answer.content_length = 0
            answer._end(None)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._body(bytes(body))

    def on_message_complete(self) -> None:
        answer = self.answer
        if answer is None:
            return
        answer._end(None)
        if answer.on_complete is not None:  # at once, before the waiting coroutine wakes
            on_complete, answer.on_complete = answer.on_complete, None
            try:
                answer.delivered = on_complete(answer)
            except Exception:
                log.exception("the callback on a complete answer failed; the answer goes the usual way")


class _HostPool:
    """Connections to one replica: idle ones reused newest first, at most `limit` open (0: no limit)."""

    def __init__(self, host: str, port: int, limit: int, keepalive_s: float, tls: ssl.SSLContext | None,
                 dead_after_s: int = DEAD_AFTER_S) -> None:
        self.host, self.port = host, port
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.tls = tls
        self.dead_after_s = dead_after_s
        self.idle: list[_Connection] = []
        self.busy: set[_Connection] = set()  # carrying a request
        self.open = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        name = host if ":" not in host else f"[{host}]"
        self.host_header = name if port == (443 if tls else 80) else f"{name}:{port}"

    async def acquire(self, connect_timeout: float) -> _Connection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()  # stale: the replica may be about to close it (its keep-alive is longer)
            self.forget(conn)
        while self.limit and self.open >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the turn passes to the next waiter
                raise
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
            if self.idle:
                return await self.acquire(connect_timeout)
        self.open += 1
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.tls,
                    server_hostname=self.host if self.tls else None)
        except TimeoutError:
            self._closed_one()
            raise ConnectFailed(f"connect to {self.host}:{self.port} timed out after {connect_timeout:g}s") from None
        except OSError as exc:  # ssl.SSLError (a certificate refused) included
            self._closed_one()
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        except BaseException:
            self._closed_one()
            raise
        assert conn.transport is not None
        keep_probing(conn.transport, self.dead_after_s)
        return conn

    def lost(self, why: str) -> int:
        """The host may be lost (a connection to it timed out, or its poll failed): every connection to it
        that has heard nothing from its kernel for SILENT_S is given up, idle or waiting on an answer's
        first byte (their requests go elsewhere); one whose answer has begun is left to its own probes, its
        bytes are on the client's way. Connections still hearing from the host (it came back; a late error
        of a connection stuck before; another of its addresses) are kept. Returns how many were given up;
        none without keepalive (--upstream-dead-after 0), where silence says nothing."""
        if not self.dead_after_s:  # no probes: a connection's silence says nothing of its host
            return 0
        doomed = []
        for conn in [c for c in self.busy if not c._got_bytes] + self.idle:
            if not conn.closed:
                silent = silent_s(conn.transport)
                if silent is None or silent >= SILENT_S:
                    doomed.append(conn)
        if doomed:
            log.warning("giving up %d connections to %s:%s: %s", len(doomed), self.host, self.port, why)
        for conn in doomed:
            conn.give_up(why)
        return len(doomed)

    def release(self, conn: _Connection) -> None:
        if conn.closed:
            self.forget(conn)
            return
        if len(self.idle) >= MAX_IDLE_PER_HOST:
            conn.close()
            return  # connection_lost forgets it
        conn.idle_since = time.monotonic()
        self.idle.append(conn)
        self._wake_one()

    def forget(self, conn: _Connection) -> None:
        """A connection closed: it no longer counts (once)."""
        if conn.forgotten:
            return
        conn.forgotten = True
        if conn in self.idle:
            self.idle.remove(conn)
        self._closed_one()

    def _closed_one(self) -> None:
        self.open = max(0, self.open - 1)
        self._wake_one()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class WireClient:
    """Keep-alive pools to the replicas, by (scheme, host, port); https with `tls` (default: the system's
    trusted CAs, hostnames checked)."""

    def __init__(self, limit_per_host: int = 0, keepalive_s: float = 4.0, tls: ssl.SSLContext | None = None,
                 dead_after_s: int = DEAD_AFTER_S) -> None:
        self.limit_per_host = limit_per_host
        self.keepalive_s = keepalive_s
        self.dead_after_s = dead_after_s
        self._tls = tls
        self.pools: dict[tuple[str, str, int], _HostPool] = {}
        self._targets: dict[str, tuple[_HostPool, str]] = {}  # base URL -> its pool and path prefix

    @property
    def tls(self) -> ssl.SSLContext:
        if self._tls is None:  # made at the first https target: loading the CAs takes a while
            self._tls = ssl.create_default_context()
        return self._tls

    def _target(self, base_url: str) -> tuple[_HostPool, str]:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"not an http or https URL: {base_url}")
        secure = parts.scheme == "https"
        host, port = parts.hostname or "", parts.port or (443 if secure else 80)
        pool = self.pools.get((parts.scheme, host, port))
        if pool is None:
            pool = self.pools[(parts.scheme, host, port)] = _HostPool(
                host, port, self.limit_per_host, self.keepalive_s, self.tls if secure else None, self.dead_after_s)
        target = self._targets[base_url] = (pool, parts.path.rstrip("/"))
        return target

    async def request(self, base_url: str, method: str, raw_path: str, headers: dict[str, str], body: bytes,
                      *, total_s: float | None, connect_timeout: float,
                      on_complete: Callable[[Answer], object] | None = None) -> Answer:
        """Send the request and wait for the answer's head; `total_s` (seconds) bounds the whole
        exchange, the body's reading included. `on_complete(answer)`, if given, is called from the
        connection's callback the moment the whole answer is here (when that is before the caller has
        woken up: a short answer), and what it returns is the answer's `delivered`."""
        pool, base_path = self._targets.get(base_url) or self._target(base_url)
        deadline = None if total_s is None else asyncio.get_running_loop().time() + total_s
        trace = UPSTREAM_TRACE.get()
        if trace is not None:  # a CLIENT span, and its traceparent in place of the client's
            headers = dict(headers)
            traced = trace.start(method, base_url + raw_path.partition("?")[0], pool.host, pool.port, headers)
        try:
            lines = [method, " ", base_path, raw_path, " HTTP/1.1\r\nhost: ", pool.host_header, "\r\n"]
            for name, value in headers.items():
                if "\r" in value or "\n" in value:
                    raise ValueError(f"header {name} carries a line break")
                lines += (name, ": ", value, "\r\n")
            if body or method in ("POST", "PUT", "PATCH"):
                lines += ("content-length: ", str(len(body)), "\r\n")
            lines.append("\r\n")
            # built before a connection is taken, so a refusal leaks none
            data = "".join(lines).encode("latin-1") + body
            conn = await pool.acquire(connect_timeout)
            answer = Answer(conn, deadline)
            answer.on_complete = on_complete
            try:
                future = conn.start(answer, data, method == "HEAD")
                await _within(future, deadline)
            except BaseException:
                conn.finished(answer, reusable=False)
                raise
        except BaseException as exc:
            if trace is not None:
                trace.failed(traced, exc)
            raise
        if trace is not None:
            trace.end(traced, answer.status)
        return answer

    def suspect(self, base_url: str, why: str) -> int:
        """`base_url`'s replica did not answer its poll: give up the connections to it that hear nothing
        from its host (`_HostPool.lost`), so requests whose bytes it never acknowledged (which keepalive
        does not probe) go elsewhere too. Returns how many were given up."""
        target = self._targets.get(base_url)
        return 0 if target is None else target[0].lost(why)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        self._targets.clear()
