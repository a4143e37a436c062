"""What embedfleet/httpserver.py takes from uvicorn's and httptools' insides, present in the installed
releases: its protocol subclasses uvicorn's httptools protocol and calls the parser itself, so a release
that renames or drops any of these fails here, before a bound goes quietly missing. (pyproject.toml pins
both with an upper bound; widening a pin starts with this test.)"""

from __future__ import annotations

import asyncio
import inspect

import httptools
import uvicorn
from uvicorn.protocols.http import flow_control, httptools_impl

from embedfleet.httpserver import BoundedProtocol, Limits, server

# methods of HttpToolsProtocol that BoundedProtocol overrides, calls or relies on being called by httptools
PROTOCOL_METHODS = ("connection_made", "connection_lost", "data_received", "eof_received", "on_message_begin",
                    "on_header", "on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
                    "send_400_response", "timeout_keep_alive_handler", "_unset_keepalive_if_required",
                    "_unsupported_upgrade_warning")
# what an instance has after connection_made (set in __init__ or there)
PROTOCOL_STATE = ("connections", "parser", "cycle", "pipeline", "flow", "loop", "transport", "headers", "client",
                  "timeout_keep_alive", "timeout_keep_alive_task")
CYCLE_STATE = ("response_started", "response_complete", "disconnected", "message_event", "transport")


def test_uvicorn_protocol_has_what_the_subclass_uses() -> None:
    for name in PROTOCOL_METHODS:
        assert callable(getattr(httptools_impl.HttpToolsProtocol, name, None)), f"HttpToolsProtocol.{name} is gone"
    assert set(httptools_impl.STATUS_LINE) >= {400, 408, 431, 503}
    assert callable(getattr(flow_control.FlowControl, "resume_reading", None))
    assert "read_paused" in inspect.signature(flow_control.FlowControl.__init__).parameters or \
        "read_paused" in inspect.getsource(flow_control.FlowControl.__init__)
    params = inspect.signature(httptools_impl.RequestResponseCycle.__init__).parameters
    assert "transport" in params and "flow" in params
    source = inspect.getsource(httptools_impl.RequestResponseCycle)
    for name in CYCLE_STATE:
        assert f"self.{name}" in source, f"RequestResponseCycle.{name} is gone"
    for name in ("http", "loop", "lifespan", "log_config", "access_log", "server_header", "date_header",
                 "timeout_keep_alive", "backlog", "proxy_headers", "timeout_graceful_shutdown", "ws"):
        assert name in inspect.signature(uvicorn.Config.__init__).parameters, f"uvicorn.Config({name}=) is gone"


def test_httptools_parser_raises_what_the_subclass_catches() -> None:
    """A callback's exception stops the parse and comes out as HttpParserCallbackError (an HttpParserError);
    trailers reach on_header after on_headers_complete."""
    assert issubclass(httptools.HttpParserCallbackError, httptools.HttpParserError)
    assert issubclass(httptools.HttpParserUpgrade, Exception)
    seen: list[str] = []

    class Stop(Exception):
        pass

    class Proto:
        def on_header(self, name: bytes, value: bytes) -> None:
            seen.append(name.decode())
            if name == b"X-Stop":
                raise Stop

        def on_headers_complete(self) -> None:
            seen.append("|")

    parser = httptools.HttpRequestParser(Proto())
    parser.feed_data(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\nX-T: 1\r\n")
    try:
        parser.feed_data(b"X-Stop: 1\r\nX-After: 1\r\n\r\n")
    except httptools.HttpParserError as exc:
        assert isinstance(exc, httptools.HttpParserCallbackError)
    else:
        raise AssertionError("a callback's exception did not stop the parse")
    assert seen == ["Host", "Transfer-Encoding", "|", "X-T", "X-Stop"]


def test_a_bounded_server_builds_and_starts() -> None:
    async def app(scope, receive, send) -> None:  # never called
        raise AssertionError

    async def main() -> None:
        srv = server(app, "127.0.0.1", 0, Limits())
        await srv.startup()
        try:
            protocol = srv.config.http_protocol_class
            assert issubclass(protocol, BoundedProtocol)
            assert srv.server_state.connections == set()
        finally:
            await srv.shutdown()

    asyncio.run(main())
