"""embedfleet's HTTP/1.1 server: an asyncio protocol parsing requests with httptools, and nothing else
between the socket and the handler. The gateway serves its proxy with it, and the runtime its ASGI
application (runtime/asgi.py), in place of uvicorn.

Why not an off-the-shelf server: issue 15 allows the gateway 0.5 ms at concurrency 1, and
bench/gateway_floor.py measured what each layer of a Python proxy costs here: a raw httptools protocol
passing bytes 0.22-0.26 ms, uvicorn with a bare ASGI app 0.39-0.44 ms, an aiohttp application with one
route 0.54-0.55 ms. aiohttp's server alone used the whole budget. The runtime's single query (issue 14)
pays the same difference (bench/fastpath.py).

What a server of ours needs, and so what this does:
- keep-alive and pipelining: one connection's requests are answered in order, one at a time;
- request bodies by Content-Length or chunked, bounded by the payload limit. An oversized request is
  still handed to the handler, marked `oversized`, so that it is refused with the handler's own 413 and
  counted; a declared length over the limit is refused before its body is read, and the connection
  closes after the refusal (the rest of the body is never read);
- `Expect: 100-continue` (curl sends it for bodies over 1 KiB) answered before the body is read;
- heads bounded (431), malformed requests answered 400, and the connection closed after either;
- a client that goes away: by default its handler is cancelled, as aiohttp's `handler_cancellation`
  did (a held request whose client left stops counting); with `cancel_on_disconnect=False` the
  handler runs on and `Call.disconnected()` resolves instead (ASGI's `http.disconnect`: the runtime
  drops the client's queued work itself and counts it);
- answers whole (`Reply`) or streamed (`Call.stream`) with back-pressure (the transport's
  pause_writing), chunked when their length is not known;
- idle keep-alive connections closed after `idle_timeout_s`; `close()` closes idle ones at once and
  busy ones once their answer is out.

It speaks plain HTTP/1.1 only: TLS ends in front of it (a Service, an Ingress, a Gateway).
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from urllib.parse import parse_qsl, unquote

import httptools
import orjson
from multidict import CIMultiDict, MultiDict

log = logging.getLogger("embedfleet.front")

MAX_HEAD_BYTES = 64 * 1024  # request line and headers together; 431 beyond
IDLE_TIMEOUT_S = 75.0  # an idle keep-alive connection is closed after this long (aiohttp's default)
IDLE_SWEEP_S = 5.0  # how often idle connections are looked for
LINGER_S = 2.0  # after refusing a request whose body was left unread, its bytes are dropped this long at most
MAX_QUEUED = 16  # parsed requests waiting on one connection (pipelining) before reading from it pauses
NO_BODY_STATUS = frozenset({204, 304})
REASONS = {int(s): s.phrase for s in http.HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
JSON = "application/json"


Headers = Iterable[tuple[str, str]] | bytes


class Reply:
    """An answer given whole: status, headers (name, value), or already rendered as header lines (bytes,
    each ending in CRLF: passed on as they came from a replica), and body."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(self, status: int, body: bytes = b"", headers: Headers = (), reason: str | None = None) -> None:
        self.status, self.body, self.headers, self.reason = status, body, headers, reason


def json_reply(doc: object, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> Reply:
    return Reply(status, orjson.dumps(doc), [("content-type", JSON), *headers])


class Call:
    """One request: what the handler reads of it, and the way to stream an answer back."""

    __slots__ = ("_conn", "_gone", "_query", "body", "headers", "keep_alive", "method", "oversized", "path",
                 "query_string", "raw_headers", "raw_path", "sent", "version")

    def __init__(self, conn: _Connection, method: str, raw_path: str, path: str, query_string: str,
                 headers: CIMultiDict[str], version: str, keep_alive: bool) -> None:
        self._conn = conn
        self.method, self.raw_path, self.path, self.query_string = method, raw_path, path, query_string
        self.headers, self.version, self.keep_alive = headers, version, keep_alive
        self.body = b""
        self.oversized: int | None = None  # over --payload-limit: its declared length, or -1 (chunked)
        self.sent: Reply | None = None  # answered by `send` before the handler returned
        self.raw_headers: list[tuple[bytes, bytes]] = []  # as received, names lower-cased (ASGI's form)
        self._query: MultiDict[str] | None = None
        self._gone: asyncio.Future[None] | None = None

    @property
    def peer(self) -> tuple[str, int] | None:
        """The client's address and port, as the socket has it."""
        return self._conn.peer

    async def disconnected(self) -> None:
        """Resolves when the client's connection closes (with `cancel_on_disconnect=False`; else the
        handler is cancelled first)."""
        if self._conn.closed:
            return
        if self._gone is None:
            self._gone = self._conn.loop.create_future()
        await asyncio.shield(self._gone)

    def _went_away(self) -> None:
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)

    @property
    def query(self) -> MultiDict[str]:
        if self._query is None:
            self._query = MultiDict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    def send(self, reply: Reply) -> Reply:
        """Answer now, before the handler returns (which it then does with this reply): what the handler
        still does after (its bookkeeping) is no longer between the client and its answer."""
        self._conn.answer(self, reply)
        self.sent = reply
        return reply

    def stream(self, status: int, reason: str | None, headers: Headers, length: int | None) -> Stream:
        """Begin an answer whose body is written part by part; return it from the handler once ended."""
        return Stream(self._conn, self, status, reason, headers, length)

    def abort(self) -> None:
        """Close the client's connection at once (an answer that cannot be finished)."""
        self._conn.close()


Handler = Callable[[Call], Awaitable["Reply | Stream"]]


class Stream:
    """An answer sent as it comes: the head at once, then `write` each part, then `end`."""

    def __init__(self, conn: _Connection, call: Call, status: int, reason: str | None, headers: Headers,
                 length: int | None) -> None:
        self.status = status
        self.ended = False
        self._conn = conn
        self._head_only = call.method == "HEAD" or status in NO_BODY_STATUS
        self._chunked = length is None and call.version == "1.1" and not self._head_only
        if length is None and not self._chunked and not self._head_only:
            call.keep_alive = False  # an HTTP/1.0 client: the body ends where the connection does
        framing = ("content-length", str(length)) if length is not None else \
            ("transfer-encoding", "chunked") if self._chunked else None
        conn.write(_head(status, reason, headers, framing, conn.closes_after(call)))
        conn.streaming = True

    async def write(self, data: bytes) -> None:
        if not data or self._head_only:
            return
        self._conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        await self._conn.drain()

    async def end(self) -> None:
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self.ended = True
        await self._conn.drain()


class Front:
    """The server: its listening socket and its connections."""

    def __init__(self, handler: Handler, payload_limit: int, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 cancel_on_disconnect: bool = True) -> None:
        self.handler = handler
        self.payload_limit = payload_limit
        self.idle_timeout_s = idle_timeout_s
        self._sweep_every = min(IDLE_SWEEP_S, idle_timeout_s)
        self.cancel_on_disconnect = cancel_on_disconnect
        self.connections: set[_Connection] = set()
        self.closing = False
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=backlog,
                                                reuse_address=True)
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for `idle_timeout_s`: one timer for all, rather than one per request."""
        cutoff = time.monotonic() - self.idle_timeout_s
        for conn in list(self.connections):
            if conn.idle() and conn.last_active < cutoff:
                conn.close()
        if not self.closing:
            self._sweeper = asyncio.get_running_loop().call_later(self._sweep_every, self._sweep)

    @property
    def port(self) -> int:
        """The port listened on (when started on port 0)."""
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening; close idle connections now and busy ones once their answer is out (at most
        `grace_s` seconds, then at once)."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle():
                conn.close()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:  # noqa: ASYNC110 (closing happens once)
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()


class _Connection(asyncio.Protocol):
    """One client connection: parses its requests and answers them in order."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: collections.deque[Call | Reply] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.current: Call | None = None  # the request being answered
        self.peer: tuple[str, int] | None = None
        self.closed = False
        self.stop_reading = False  # nothing more is parsed: an answer ends this connection
        self.streaming = False  # the current answer's head is out (Stream)
        self._paused_reading = False
        self._writable: asyncio.Future[None] | None = None
        self.last_active = time.monotonic()
        # the request being parsed
        self._call: Call | None = None
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._head_too_large = False

    # -- state

    def idle(self) -> bool:
        return self.task is None and not self.queue

    def closes_after(self, call: Call) -> bool:
        return not call.keep_alive or call.oversized is not None or self.front.closing

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._writable is not None:
            await self._writable

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.close()
        self.closed = True

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None
        self.front.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.stop_reading:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._stop_reading()  # what follows is not HTTP/1.1; the request itself was queued
            if self.idle():
                self.close()
        except httptools.HttpParserError as exc:
            if self._head_too_large:
                self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes", "head_too_large")
            else:
                self._refuse(400, f"malformed HTTP request: {exc}", "bad_request")

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.front.connections.discard(self)
        if self.task is not None:
            if self.front.cancel_on_disconnect:
                self.task.cancel()  # the client left: its request stops (and stops counting) now
            elif self.current is not None:
                self.current._went_away()
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the client closed the connection"))
            self._writable.exception()  # retrieved: nobody may be waiting

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers, self._raw_headers, self._head_bytes = b"", [], [], 0
        self._body, self._body_bytes, self._call = [], 0, None

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))
        self._raw_headers.append((name.lower(), value))
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            self._head_too_large = True
            raise ValueError("request head too large")  # httptools stops parsing: HttpParserCallbackError

    def on_headers_complete(self) -> None:
        if self.stop_reading:  # pipelined after a request that ends the connection: never answered
            return
        parser = self.parser
        raw = self._url
        if raw[:1] == b"/" and b"?" not in raw and b"%" not in raw:  # the usual target: nothing to split or unquote
            query = ""
            call_path = raw_path = raw.decode("latin-1")
        else:
            url = httptools.parse_url(raw)
            path = url.path.decode("latin-1")
            query = url.query.decode("latin-1") if url.query is not None else ""
            call_path, raw_path = unquote(path), path + ("?" + query if query else "")
        headers = CIMultiDict(self._headers)
        call = Call(self, parser.get_method().decode("latin-1"), raw_path, call_path, query, headers,
                    parser.get_http_version(), parser.should_keep_alive())
        call.raw_headers = self._raw_headers
        self._call = call
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.front.payload_limit:
            call.oversized = int(length)  # refused before its body is read; the connection ends after
            self._queue(call)
            self._stop_reading()
            return
        if headers.get("expect", "").lower() == "100-continue" and self.idle():
            self.write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        call = self._call
        if call is None or call.oversized is not None:
            return
        self._body_bytes += len(body)
        if self._body_bytes > self.front.payload_limit:
            call.oversized, self._body = -1, []
            return
        self._body.append(bytes(body))

    def on_message_complete(self) -> None:
        call = self._call
        if call is None or self.stop_reading:
            return
        call.body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body = []
        self._queue(call)
        if call.oversized is not None or not call.keep_alive:
            self._stop_reading()

    # -- answering

    def _queue(self, item: Call | Reply) -> None:
        self.queue.append(item)
        if len(self.queue) >= MAX_QUEUED and not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    def _refuse(self, status: int, message: str, code: str) -> None:
        """The bytes are not a request we can answer: say so after what was queued, then close."""
        self._queue(json_reply({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                               status))
        self._stop_reading()

    def _stop_reading(self) -> None:
        """Parse nothing more; what still arrives is read and dropped, so that closing after the last
        answer does not reset the connection under a client still sending (see `_close_after_refusal`)."""
        self.stop_reading = True

    def _close_after_refusal(self) -> None:
        """Close once a refusal is out, with the client perhaps still sending the refused body: closing
        a socket with unread bytes resets the connection, and a reset can reach the client before it
        has read the refusal. So: end our side, drop what still comes, close at its end or in
        LINGER_S."""
        if self.closed or self.transport is None:
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.close)
        else:
            self.close()

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                item = self.queue.popleft()
                if self._paused_reading and len(self.queue) < MAX_QUEUED // 2 and self.transport is not None:
                    self._paused_reading = False
                    self.transport.resume_reading()
                if isinstance(item, Reply):  # a refusal of bytes that were no request: the last answer
                    self.write(_head(item.status, item.reason, item.headers, ("content-length", str(len(item.body))),
                                     True) + item.body)
                    self._close_after_refusal()
                    return
                call = self.current = item
                self.streaming = False
                try:
                    answer = await self.front.handler(call)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s %s failed", call.method, call.path)
                    if self.streaming:  # its head is out: the client must see it end
                        self.close()
                        return
                    answer = call.sent or json_reply({"error": {"message": "internal error in the server",
                                                   "type": "server_error", "code": "internal_error"}}, 500)
                if isinstance(answer, Reply):
                    if call.sent is None:
                        self.answer(call, answer)
                elif not answer.ended:  # a streamed answer that broke off: the client must see it end
                    self.close()
                    return
                if call.oversized is not None:
                    self._close_after_refusal()
                    return
                if self.closes_after(call) or (self.stop_reading and not self.queue):
                    self.close()
                    return
        finally:
            self.task = self.current = None
            self.last_active = time.monotonic()

    def answer(self, call: Call, reply: Reply) -> None:
        no_body = call.method == "HEAD" or reply.status in NO_BODY_STATUS
        framing = None if reply.status in NO_BODY_STATUS else ("content-length", str(len(reply.body)))
        head = _head(reply.status, reply.reason, reply.headers, framing, self.closes_after(call))
        self.write(head if no_body else head + reply.body)



_date: tuple[int, bytes] = (0, b"")


def _date_header() -> bytes:
    """The Date header, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, b"date: " + formatdate(now, usegmt=True).encode("latin-1") + b"\r\n")
    return _date[1]


def _head(status: int, reason: str | None, headers: Headers, framing: tuple[str, str] | None, close: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, (reason or REASONS.get(status, "")).encode("latin-1")),
             _date_header()]
    if isinstance(headers, bytes):  # rendered already (a replica's, as parsed: no line breaks inside)
        lines.append(headers)
    else:
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} carries a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    if framing is not None:
        lines.append(f"{framing[0]}: {framing[1]}\r\n".encode("latin-1"))
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)
