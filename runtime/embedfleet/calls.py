"""A request as one call to a handler, served over ASGI: the gateway's proxy works on this shape.

The proxy needs the whole request body before it picks a replica (it may retry on another one), and gives
back either a whole answer (`Reply`, its headers perhaps already rendered as lines, as a replica sent
them) or one streamed part by part (`Call.stream`). `CallApp` turns that into an ASGI application for
httpserver.py (uvicorn), and:
- reads the body up to the payload limit: a declared length over it is not read at all, a chunked body is
  refused as soon as it passes the limit (the client may still be sending); either way the handler sees
  `Call.oversized` and answers 413, and the connection closes after it;
- a handler that fails before answering gets a 500 in the error shape; after its head is out, the
  connection is closed (the client sees a broken answer, never a wrong one);
- a client that goes away cancels its handler (ASGI's `http.disconnect`, watched while the handler runs):
  a held request stops counting, an upstream request is abandoned.

A module of the small common package (the top-level ``embedfleet.*`` modules: otel, calls, httpserver,
compat, api_group), shared by components: it must import nothing from embedfleet.runtime, .operator,
.gateway or .client (tests/packaging/test_boundaries.py checks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl

import orjson
from multidict import CIMultiDict, MultiDict

log = logging.getLogger("embedfleet.calls")

JSON = "application/json"
NO_BODY_STATUS = frozenset({204, 304})
CLOSE = (b"connection", b"close")
FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})

Headers = Iterable[tuple[str, str]] | bytes


class Reply:
    """An answer given whole: status, headers (name, value), or already rendered as header lines (bytes,
    each ending in CRLF: passed on as they came from a replica), and body."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(self, status: int, body: bytes = b"", headers: Headers = (), reason: str | None = None) -> None:
        self.status, self.body, self.headers, self.reason = status, body, headers, reason


def json_reply(doc: object, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> Reply:
    return Reply(status, orjson.dumps(doc), [("content-type", JSON), *headers])


def asgi_headers(headers: Headers) -> list[tuple[bytes, bytes]]:
    """Headers as ASGI wants them; rendered lines are split back (a replica's, as parsed: no line breaks
    inside a value), framing headers left to the server."""
    out = []
    if isinstance(headers, bytes):
        for line in headers.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if sep and name.strip().lower() not in FRAMING:
                out.append((name.strip().lower(), value.strip()))
        return out
    for name, value in headers:
        raw = name.lower().encode("latin-1")
        if raw not in FRAMING:
            out.append((raw, value.encode("latin-1")))
    return out


class Aborted(Exception):
    """The handler broke off an answer it had begun: the server closes the connection."""


class Call:
    """One request: what the handler reads of it, and the way to stream an answer back."""

    __slots__ = ("_query", "_receive", "_send", "aborted", "body", "headers", "keep_alive", "method", "oversized",
                 "path", "peer", "query_string", "raw_headers", "raw_path", "sent", "streamed", "version")

    def __init__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                 send: Callable[[dict], Awaitable[None]]) -> None:
        self._receive, self._send = receive, send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        query = scope.get("query_string", b"")
        self.query_string = query.decode("latin-1")
        raw = scope.get("raw_path") or self.path.encode("latin-1")
        self.raw_path = raw.decode("latin-1") + ("?" + self.query_string if query else "")
        self.raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        self.headers = CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in self.raw_headers)
        self.version: str = scope.get("http_version", "1.1")
        self.keep_alive = self.version != "1.0" and "close" not in self.headers.get("connection", "").lower()
        client = scope.get("client")
        self.peer: tuple[str, int] | None = (str(client[0]), int(client[1])) if client else None
        self.body = b""
        self.oversized: int | None = None  # over the payload limit: its declared length, or -1 (chunked)
        self.sent: Reply | None = None
        self.streamed: Stream | None = None
        self.aborted = False
        self._query: MultiDict[str] | None = None

    @property
    def query(self) -> MultiDict[str]:
        if self._query is None:
            self._query = MultiDict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    async def disconnected(self) -> None:
        """Resolves when the client's connection closes."""
        while (await self._receive())["type"] != "http.disconnect":
            pass

    def send(self, reply: Reply) -> Reply:
        """The answer (the handler returns it too); it goes out as the handler returns."""
        self.sent = reply
        return reply

    def stream(self, status: int, reason: str | None, headers: Headers, length: int | None) -> Stream:
        """Begin an answer whose body is written part by part; return it from the handler once ended."""
        self.streamed = Stream(self, status, headers, length)
        return self.streamed

    def abort(self) -> None:
        """The answer cannot be finished: the connection closes once the handler returns."""
        self.aborted = True


Handler = Callable[[Call], Awaitable["Reply | Stream"]]


class Stream:
    """An answer sent as it comes: the head with the first part, then `write` each part, then `end`."""

    def __init__(self, call: Call, status: int, headers: Headers, length: int | None) -> None:
        self.status = status
        self.ended = False
        self._call = call
        self._started = False
        self._headers = asgi_headers(headers)
        if length is not None:
            self._headers.append((b"content-length", str(length).encode()))
        if not call.keep_alive:
            self._headers.append(CLOSE)

    async def _start(self) -> None:
        if not self._started:
            self._started = True
            await self._call._send({"type": "http.response.start", "status": self.status, "headers": self._headers})

    @property
    def started(self) -> bool:
        return self._started

    async def write(self, data: bytes) -> None:
        await self._start()
        if data:
            await self._call._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self._start()
        await self._call._send({"type": "http.response.body", "body": b"", "more_body": False})
        self.ended = True


class CallApp:
    """An ASGI application calling `handler` with each request, its body read first."""

    def __init__(self, handler: Handler, payload_limit: int) -> None:
        self.handler = handler
        self.payload_limit = payload_limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        call = Call(scope, receive, send)
        if not await self._read_body(call):
            return  # the client left while sending
        me = asyncio.current_task()
        assert me is not None
        watcher = asyncio.get_running_loop().create_task(self._cancel_when_gone(call, me))
        try:
            answer = await self.handler(call)
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():  # the client left: its request stops here
                me.uncancel()
                return
            raise
        except Exception:
            log.exception("%s %s failed", call.method, call.path)
            if call.streamed is not None and call.streamed.started:
                raise Aborted("the answer broke off") from None
            answer = json_reply({"error": {"message": "internal error in the server", "type": "server_error",
                                           "code": "internal_error"}}, 500)
        finally:
            watcher.cancel()
        if isinstance(answer, Stream):
            if call.aborted or not answer.ended:
                raise Aborted("the answer broke off")
            return
        reply = call.sent or answer
        headers = asgi_headers(reply.headers)
        if reply.status not in NO_BODY_STATUS:
            headers.append((b"content-length", str(len(reply.body)).encode()))
        if call.oversized is not None or not call.keep_alive:
            headers.append(CLOSE)
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if reply.status in NO_BODY_STATUS else reply.body})

    @staticmethod
    async def _cancel_when_gone(call: Call, handler: asyncio.Task) -> None:
        """A client that goes away takes its request with it (a held request stops counting, an upstream
        request is abandoned), as aiohttp's `handler_cancellation` does."""
        await call.disconnected()
        handler.cancel()

    async def _read_body(self, call: Call) -> bool:
        """The body into `call.body`, or `call.oversized` set; False when the client left meanwhile."""
        length = call.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.payload_limit:
            call.oversized = int(length)  # refused before its body is read
            return True
        parts: list[bytes] = []
        size = 0
        while True:
            message = await call._receive()
            if message["type"] != "http.request":
                return False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.payload_limit:
                call.oversized = -1  # refused now, while the client may still be sending
                return True
            if chunk:
                parts.append(chunk)
            if not message.get("more_body", False):
                break
        call.body = parts[0] if len(parts) == 1 else b"".join(parts)
        return True
