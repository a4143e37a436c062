"""The HTTP/1.1 server of the runtime and the gateway: uvicorn with its httptools protocol, bounded.

Why uvicorn and not a server of our own: bench/http_servers.py measures our former hand-written server
against uvicorn (httptools and h11) and granian in one run; it saved 0.02-0.03 ms a request at c=1 over
uvicorn with httptools, far under the 0.2 ms that would pay for keeping a parser loop of our own
(docs/http.md has the figures). uvicorn leaves these things unbounded, and `BoundedProtocol` adds them
without touching how it parses or answers:

- **connections**: at `max_connections` open connections in this process, a new one makes room by closing
  the connection quiet the longest among those with no request in flight (an idle keep-alive, or an
  unfinished head); when every one has a request in flight, the new one gets a fixed 503 and is closed
  before a byte of it is read. Each process counts its own, so the bound holds however many run;
- **an unfinished request head, and trailers**: httptools keeps an incomplete header in a buffer it grows
  by copying, and uvicorn has no head limit. Here the bytes of a head are counted as they are fed, in
  slices, and past `max_head_bytes` the client gets 431 and the connection closes: httptools never holds
  more than the limit and one slice. The header lines of a message are counted too, past `max_headers`
  the same 431. A chunked body's trailers count against both (its bytes that are no body data, since the
  last body data); trailers are never added to the request's headers. When the answer has already begun,
  the connection is closed instead;
- **pipelining**: httptools parses all it is fed, so one read of pipelined requests became thousands of
  queued requests. Here no feed holds more than one possible end of a message (`\r\n\r\n`), and nothing
  of a next head is fed while one request is being answered, so at most one request is parsed ahead of
  the one answered, whatever the size of the reads; the rest is held (at most `HOLD_BYTES` and one read,
  reading paused beyond) and parsed once the answer is out.
  Answers go out in order, one at a time, each task yielding to the loop, and uvicorn's own `send` waits
  for the write buffer to drain (`pause_writing`) before it writes more;
- **time**: uvicorn closes an idle keep-alive connection, but never one that is slow in sending its head
  or body, nor a new connection that sends nothing. Here: `head_timeout_s` between bytes of an unfinished
  head, `head_total_s` for a whole head, `body_timeout_s` for a body that stops moving (while the server
  reads; a body the application is not reading yet does not count), `keep_alive_s` for a connection with
  nothing in flight, from its opening too. Each is refreshed by progress. A body must also keep an average
  rate: by `body_timeout_s` + received / `min_body_rate` seconds from its start (Apache's
  `RequestReadTimeout body=...,MinRate=...`), less the time the server was not reading it, or it is cut. A
  head timeout answers 408; a body cut answers 408 when the answer has not begun; the others close;
- **a refusal before the body is read**: when the application answers (413, say) and closes while the
  client is still sending, closing a socket with unread bytes resets it, and the reset can reach the
  client before the answer. Here our side ends (FIN), what still comes is read and dropped, and the
  socket closes at the client's end, after `LINGER_S` or past `LINGER_BYTES`.
The request body limit itself belongs to the application (the runtime's gate and the gateway refuse as
the body arrives, so a chunked body over the limit is refused as soon as it passes it).

A module of the small common package (the top-level ``embedfleet.*`` modules: otel, calls, httpserver,
compat, api_group), shared by components: it must import nothing from embedfleet.runtime, .operator,
.gateway or .client (tests/packaging/test_boundaries.py checks).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("embedfleet.http")

SLICE = 4096  # bytes of a head (or of a body of unknown length) fed to httptools at a time
BODY_SLICE = 65536  # bytes of a body of known length fed at a time
HOLD_BYTES = 65536  # held bytes of a next request beyond which reading pauses
LINGER_S = 2.0  # a refused request's rest is read and dropped this long at most,
LINGER_BYTES = 1 << 20  # and this much
END = b"\r\n\r\n"  # ends every head, trailers and chunked body: what no feed holds twice
_BUSY = orjson.dumps({"error": {"message": "too many open connections", "type": "server_error",
                                 "code": "too_many_connections"}})
BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%b" % (len(_BUSY), _BUSY))


@dataclass(frozen=True)
class Limits:
    """The bounds of one server's connections (each a flag of `embedfleet serve` and `embedfleet gateway`)."""

    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 5.0
    head_total_s: float = 30.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 65.0
    max_headers: int = 100  # header lines of one message, trailers included (nginx: 100 by default, hyper 100)
    max_connections: int = 1024  # open connections of one server process
    min_body_rate: float = 500.0  # bytes/s a body must average after its first body_timeout_s (Apache: 500)


def add_limit_arguments(parser: Any, keep_alive_default: float) -> None:
    """The flags of `Limits` for an argparse parser (the gateway's; the runtime has them as settings)."""
    d = Limits()
    parser.add_argument("--head-timeout-seconds", type=float, default=d.head_timeout_s,
                        help=f"longest pause between bytes of a request head; 408 after (default {d.head_timeout_s})")
    parser.add_argument("--head-total-seconds", type=float, default=d.head_total_s,
                        help=f"time a whole request head may take; 408 after (default {d.head_total_s})")
    parser.add_argument("--body-timeout-seconds", type=float, default=d.body_timeout_s,
                        help=f"longest pause in a request body being read; closed after (default {d.body_timeout_s})")
    parser.add_argument("--keep-alive-seconds", type=float, default=keep_alive_default,
                        help=f"an idle client connection is closed after this (default {keep_alive_default})")
    parser.add_argument("--max-headers", type=int, default=d.max_headers,
                        help=f"most header lines in a request, trailers included; 431 beyond (default {d.max_headers})")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help="most open client connections per process; beyond it the longest-quiet one with no "
                             f"request in flight is closed, or the new one gets 503 (default {d.max_connections})")
    parser.add_argument("--min-body-rate", type=float, default=d.min_body_rate,
                        help="bytes per second a request body must average after its first --body-timeout-seconds; "
                             f"cut below it (default {d.min_body_rate:g})")


def limits_from_args(args: Any) -> Limits:
    return Limits(head_timeout_s=args.head_timeout_seconds, head_total_s=args.head_total_seconds,
                  body_timeout_s=args.body_timeout_seconds, keep_alive_s=args.keep_alive_seconds,
                  max_headers=args.max_headers, max_connections=args.max_connections,
                  min_body_rate=args.min_body_rate)


class _Refused(Exception):
    """Raised from a parser callback to stop the parse: the request is refused (`BoundedProtocol._refusal`)."""


HEAD, BODY = 0, 1


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above (`limits` is set on a subclass by `server`)."""

    limits = Limits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held = bytearray()
        self._state = HEAD
        self._head_bytes = 0  # bytes of this head fed, or of a chunked body's non-data since its last data
        self._lines = 0  # header lines of this message, trailers included
        self._max_headers = self.limits.max_headers
        self._refusal: tuple[int, str] | None = None
        self._remaining: int | None = None  # body bytes still to come (Content-Length); None: chunked or none
        self._held_paused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_deadline: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._rate_timer: asyncio.TimerHandle | None = None
        self._body_start = self._rate_checked = 0.0
        self._body_bytes = 0
        self._lingering = False
        self._turned_away = False
        self._dropped = 0
        self._quiet_since = 0.0
        self.timeout_keep_alive = self.limits.keep_alive_s

    # -- connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and not self._make_room():
            self._turned_away = True  # before uvicorn sees it: nothing is read or parsed
            transport.write(BUSY_503)
            transport.close()
            return
        super().connection_made(transport)
        self.flow = _HoldingFlow(transport, self)
        self._quiet_since = self.loop.time()
        # a connection that never sends a byte is idle from the start
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _make_room(self) -> bool:
        """Close the connection quiet the longest among those with no request in flight; False: none."""
        quiet = [c for c in self.connections if isinstance(c, BoundedProtocol) and c._evictable()]
        if not quiet:
            return False
        victim = min(quiet, key=lambda c: c._quiet_since)
        log.debug("%d connections open: closing the one quiet for %.1f s to take a new one",
                  len(self.connections), self.loop.time() - victim._quiet_since)
        victim._cancel_timers()
        victim.transport.close()
        victim.connections.discard(victim)  # its connection_lost comes later; the room is now
        return True

    def _evictable(self) -> bool:
        return (self._state == HEAD and not self._busy() and not self._lingering and not self.pipeline
                and not self.transport.is_closing())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._turned_away:
            return
        self._cancel_timers()
        self._held.clear()
        super().connection_lost(exc)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._head_deadline, self._body_timer, self._rate_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._head_deadline = self._body_timer = self._rate_timer = None

    # -- reading

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._quiet_since = self.loop.time()
        if self._lingering or self.parser is None:
            # a refused request's rest, read and dropped until the client's end, up to LINGER_BYTES
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        if (not self._held and self._state == HEAD and len(data) <= SLICE and not self._busy()
                and data.count(END) <= 1):
            self._feed(data)  # the usual request: one small read, one request at most, nothing in flight
        else:
            self._held += data
            self._feed_held()
        self._arm_progress_timers()

    def _busy(self) -> bool:
        """A request is being answered: the next one waits, unparsed."""
        return self.cycle is not None and not self.cycle.response_complete

    def _feed_held(self) -> None:
        while self._held and self.parser is not None and not self.transport.is_closing():
            if self._state == HEAD:
                if self._busy():
                    break
                n = min(SLICE, self.limits.max_head_bytes - self._head_bytes + 1)
            elif self._remaining is not None:
                n = max(1, min(BODY_SLICE, self._remaining))
            else:
                n = SLICE
            if self._state == HEAD or self._remaining is None:  # one possible end of a message per feed
                end = self._held.find(END, 0, n + len(END) - 1)
                if end >= 0:
                    n = min(n, end + len(END))
            piece = bytes(self._held[:n])
            del self._held[:n]
            if not self._feed(piece):
                self._held.clear()
                return
        if len(self._held) > HOLD_BYTES:  # again each time: uvicorn's flow control may have resumed reading
            self._held_paused = True
            self.transport.pause_reading()
        elif self._held_paused:
            self._held_paused = False
            if not self.flow.read_paused:
                self.transport.resume_reading()

    def _feed(self, data: bytes) -> bool:
        """Parse `data`; False when the connection is done with (refused)."""
        if self._state == HEAD or self._remaining is None:
            self._head_bytes += len(data)  # a chunked body's data resets it (on_body)
        before = self.transport.is_closing()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # as uvicorn with ws="none": no upgrade is served
        except httptools.HttpParserError as exc:
            if self._refusal is not None:
                self._refuse(*self._refusal)
            else:  # a client's mistake, not the server's: one line
                log.info("bad request from %s: %s", _peer(self.client), exc)
                self.send_400_response("Invalid HTTP request received.")
            return False
        if self.transport.is_closing() and not before:
            return False
        if self._head_bytes > self.limits.max_head_bytes and (self._state == HEAD or self._remaining is None):
            what = "request head" if self._state == HEAD else "chunked body's framing and trailers"
            self._refuse(431, f"{what} over {self.limits.max_head_bytes} bytes")
            return False
        return True

    def _arm_progress_timers(self) -> None:
        if self.transport.is_closing():
            return
        if self._state == HEAD and self._head_bytes > 0 and not self._busy():
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timed_out, "head")
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(self.limits.head_total_s, self._head_timed_out, "total")
        elif self._state == BODY:
            if self._body_timer is not None:
                self._body_timer.cancel()
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
            if self._rate_timer is None:  # armed once a body outlasts a read (a small request's never is)
                self._body_start = self._rate_checked = self.loop.time()
                self._rate_timer = self.loop.call_later(self.limits.body_timeout_s, self._rate_due)

    def _head_timed_out(self, which: str) -> None:
        if self._state != HEAD or self.transport.is_closing():
            return
        if self._busy():  # the next request's head waits on our answer, not on the client
            return
        seconds = self.limits.head_timeout_s if which == "head" else self.limits.head_total_s
        self._refuse(408, f"request head not received in time ({which} timeout of {seconds:g} s)")

    def _reading(self) -> bool:
        """The server reads the body now (not paused because the application or an answer is behind)."""
        return not (self.flow.read_paused or self._held_paused or self._held)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self._state != BODY or self.transport.is_closing():
            return
        if not self._reading():  # we are not reading: not the client's delay
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
            return
        self._cut_body(f"request body stopped for {self.limits.body_timeout_s:g} s")

    def _rate_due(self) -> None:
        """A body averages `min_body_rate` after its first `body_timeout_s`; time not read is not counted."""
        self._rate_timer = None
        if self._state != BODY or self.transport.is_closing():
            return
        now = self.loop.time()
        if not self._reading():
            self._body_start += now - self._rate_checked
        self._rate_checked = now
        due = self._body_start + self.limits.body_timeout_s + self._body_bytes / self.limits.min_body_rate
        if now < due:
            self._rate_timer = self.loop.call_at(min(due, now + self.limits.body_timeout_s), self._rate_due)
            return
        self._cut_body(f"request body slower than {self.limits.min_body_rate:g} bytes/s")

    def _cut_body(self, why: str) -> None:
        log.info("closing a connection from %s: %s", _peer(self.client), why)
        self._refuse(408, why)

    def _refuse(self, status: int, message: str) -> None:
        """An answer to bytes that are no request we will take, then the end of the connection (only the
        end, when an answer has begun: a second one cannot follow it)."""
        self._cancel_timers()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            if self.cycle.response_started:
                self.transport.close()
                return
        code = {431: "head_too_large", 408: "request_timeout"}[status]
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}})
        self.transport.write(STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%b" % (len(body), body))
        self._linger()

    def _linger(self) -> None:
        """End our side; drop what the client still sends; close at its end or in LINGER_S."""
        self._lingering = True
        self._held.clear()
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def eof_received(self) -> bool | None:
        if self._lingering:
            self.transport.close()
        return None

    # -- httptools callbacks (uvicorn's, plus the state the bounds need)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._lines += 1  # back to 0 when a message completes
        if self._lines > self._max_headers:
            self._refusal = (431, f"more than {self.limits.max_headers} header lines")
            raise _Refused  # stops the parse: no more header is kept
        if self._state == HEAD:
            super().on_header(name, value)
        # else a trailer: counted, never added to the headers the application already has

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._state, self._head_bytes = BODY, 0
        for timer in (self._head_timer, self._head_deadline):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._head_deadline = None
        self._remaining = None
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit():
                self._remaining = int(value)
        self._body_bytes = 0
        if self.cycle is not None:
            self.cycle.transport = _Ending(self.transport, self)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        if self._remaining is not None:
            self._remaining -= len(body)
        else:
            self._head_bytes = 0
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._state, self._head_bytes, self._remaining, self._lines = HEAD, 0, None, 0
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._held and not self.transport.is_closing():
            self.loop.call_soon(self._resume_held)  # not inside the application's `send`

    def _resume_held(self) -> None:
        if self.parser is None or self.transport.is_closing():
            return
        self._feed_held()
        self._arm_progress_timers()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class _HoldingFlow(FlowControl):
    """uvicorn's flow control, which resumes reading whenever the application reads or an answer ends;
    while a next request's held bytes are over `HOLD_BYTES`, reading stays paused (one read per answer
    would otherwise be added to them)."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedProtocol) -> None:
        super().__init__(transport)
        self._protocol = protocol

    def resume_reading(self) -> None:
        if len(self._protocol._held) > HOLD_BYTES:
            return
        super().resume_reading()


class _Ending:
    """The transport as a request's cycle sees it: a close while the request's body is still coming
    (the application refused it before reading it all) lingers instead of resetting the connection, and
    an answer to a client already gone is dropped rather than raised from the application's `send`."""

    __slots__ = ("_protocol", "_transport")

    def __init__(self, transport: asyncio.Transport, protocol: BoundedProtocol) -> None:
        self._transport, self._protocol = transport, protocol

    def write(self, data: bytes) -> None:
        if not self._transport.is_closing():  # the client left and the loop has not said so yet: nowhere to go
            self._transport.write(data)

    def close(self) -> None:
        if self._protocol._state == BODY and not self._protocol._lingering and not self._transport.is_closing():
            self._protocol._linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def server(app: Any, host: str, port: int, limits: Limits, *, lifespan: str = "off",
           graceful_s: float | None = None, backlog: int = 1024, uds: str | None = None) -> uvicorn.Server:
    """A uvicorn server for `app` with `limits`; `await srv.startup()` listens (on `uds`, a Unix socket, when
    given; `startup(sockets=...)` on sockets already listening), `await srv.shutdown()` stops (in the
    caller's loop; the caller owns its signals)."""
    protocol = type("Bounded", (BoundedProtocol,), {"limits": limits})
    config = uvicorn.Config(app, host=host, port=port, http=protocol, loop="none", lifespan=lifespan,
                            log_config=None, access_log=False, server_header=False, date_header=True,
                            timeout_keep_alive=int(max(1, limits.keep_alive_s)), backlog=backlog,
                            proxy_headers=False,  # the client is the socket's peer; no header can say otherwise
                            timeout_graceful_shutdown=graceful_s, ws="none", uds=uds)
    config.load()
    srv = uvicorn.Server(config)
    srv.lifespan = config.lifespan_class(config)  # what `serve()` would set up before `startup()`
    return srv


def bound_port(srv: uvicorn.Server) -> int:
    """The port a started server listens on (when asked for port 0)."""
    return srv.servers[0].sockets[0].getsockname()[1]
