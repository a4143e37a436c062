"""The runtime's ASGI application served by embedfleet's own HTTP/1.1 server (front.py), not uvicorn.

The application stays ASGI (FastAPI, the gate, the direct routes: api/app.py), so tests may still
serve it with any ASGI server; `embedfleet serve` serves it with front.py because a single short query
pays for every layer between the socket and the engine (issue 14; bench/fastpath.py measures it). Here:
- each request becomes an ASGI `http` scope with its whole body (front.py reads it first), and the
  answer's start and body messages one write to the socket: the head and body go out together, and
  whatever the application still does after its last body message (the gate's bookkeeping) runs after
  the client has its answer;
- an answer sent in several body messages is streamed (chunked unless its length was given);
- a client that goes away is `http.disconnect` on `receive`, as uvicorn gives it: the application
  drops the client's queued work and counts it (api/http.py `wait_disconnect`); the handler is not
  cancelled under it;
- a body over --payload-limit is answered 413 by `oversized` in the runtime's error shape;
- `Lifespan` runs the application's start-up and shutdown (the models load in the background).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from embedfleet.front import Call, Reply, Stream

log = logging.getLogger("embedfleet.runtime.access")
ASGI = {"version": "3.0", "spec_version": "2.3"}
FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})  # front.py writes its own


class BadHeader(ValueError):
    """The application tried to answer with a line break in a header (response splitting)."""


def render_headers(headers, call: Call) -> tuple[bytes, int | None]:
    """ASGI response headers as header lines, less the framing front.py writes itself; the declared
    content length, if any. `connection: close` from the application ends the connection after this
    answer (the gate sends it when it refuses a request)."""
    lines = []
    length = None
    for name, value in headers:
        lower = name.lower()
        if lower in FRAMING:
            if lower == b"content-length" and value.isdigit():
                length = int(value)
            elif lower == b"connection" and value.lower() == b"close":
                call.keep_alive = False
            continue
        if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
            raise BadHeader(f"header {name!r} carries a line break")
        lines.append(b"%s: %s\r\n" % (name, value))
    return b"".join(lines), length


class AsgiHandler:
    """front.py's handler: one request through the ASGI `app`."""

    def __init__(self, app, oversized: Callable[[Call], Reply], server: tuple[str, int] | None = None,
                 access_log: bool = False) -> None:
        self.app = app
        self.oversized = oversized
        self.server = server
        self.access_log = access_log

    async def __call__(self, call: Call) -> Reply | Stream:
        if call.oversized is not None:
            return self.oversized(call)
        path, _, _ = call.raw_path.partition("?")
        scope: dict[str, Any] = {
            "type": "http", "asgi": ASGI, "http_version": call.version, "method": call.method, "scheme": "http",
            "path": call.path, "raw_path": path.encode("latin-1"), "query_string": call.query_string.encode("latin-1"),
            "root_path": "", "headers": call.raw_headers, "client": call.peer, "server": self.server, "state": {},
        }
        exchange = _Exchange(call)
        await self.app(scope, exchange.receive, exchange.send)
        if self.access_log:
            log.info('%s - "%s %s HTTP/%s" %d', call.peer[0] if call.peer else "-", call.method, call.raw_path,
                     call.version, exchange.status)
        if call.sent is not None:
            return call.sent
        if exchange.stream is not None:
            return exchange.stream
        raise RuntimeError(f"the application sent no answer to {call.method} {call.path}")


class _Exchange:
    """The `receive` and `send` of one request."""

    __slots__ = ("call", "head", "length", "read", "status", "stream")

    def __init__(self, call: Call) -> None:
        self.call = call
        self.read = False
        self.status = 0
        self.head = b""
        self.length: int | None = None
        self.stream: Stream | None = None

    async def receive(self) -> dict:
        if not self.read:
            self.read = True
            return {"type": "http.request", "body": self.call.body, "more_body": False}
        await self.call.disconnected()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.head, self.length = render_headers(message.get("headers", ()), self.call)
            return
        if kind != "http.response.body":
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.stream is None:
            if not more:  # the usual answer: head and body in one write
                self.call.send(Reply(self.status, body, self.head))
                return
            self.stream = self.call.stream(self.status, None, self.head, self.length)
        await self.stream.write(body)
        if not more:
            await self.stream.end()


class Lifespan:
    """The application's ASGI lifespan: `startup()` before serving, `shutdown()` after."""

    def __init__(self, app) -> None:
        self.app = app
        self._in: asyncio.Queue[dict] = asyncio.Queue()
        self._out: asyncio.Queue[dict] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _expect(self, step: str) -> None:
        assert self._task is not None
        getter = asyncio.ensure_future(self._out.get())
        done, _ = await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            self._task.result()  # the application failed: raise its error
            raise RuntimeError(f"the application ended its lifespan before {step}")
        message = getter.result()
        if message["type"] == f"lifespan.{step}.failed":
            raise RuntimeError(f"application {step} failed: {message.get('message', '')}")

    async def startup(self) -> None:
        self._task = asyncio.create_task(self.app({"type": "lifespan", "asgi": ASGI, "state": {}}, self._in.get,
                                                  self._out.put))
        await self._in.put({"type": "lifespan.startup"})
        await self._expect("startup")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._in.put({"type": "lifespan.shutdown"})
        await self._expect("shutdown")
        await self._task
