"""The runtime's ASGI application on embedfleet's HTTP server (runtime/asgi.py over front.py), over real
loopback sockets, read by h11 (an independent parser).

What `embedfleet serve` relies on (the rest of the suite runs the real application this way): a whole
answer in one piece with the application's headers and no second framing; answers sent in parts
streamed; `http.disconnect` on `receive` when the client leaves, with the handler left running;
`connection: close` from the application honoured; a response header with a line break refused (500)
and the server still serving; an oversized body refused by the runtime's own 413; the lifespan's
start-up and shutdown run, and a failed start-up reported.
"""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.front import Call, Front, Reply
from embedfleet.runtime.asgi import AsgiHandler, Lifespan
from tests.gateway.test_front import PATIENCE_S, Client, header

LIMIT = 1000


class App:
    """A small ASGI application: `/echo`, `/parts` (three body messages), `/bye` (asks to close),
    `/split` (a header with a line break), `/wait` (waits for the client to leave)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.gone = asyncio.Event()
        self.waiting = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.events.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        request = await receive()
        if path == "/parts":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/wait":
            self.waiting.set()
            message = await receive()
            self.events.append(message["type"])
            self.gone.set()
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", b"999")]  # ours: replaced
        if path == "/bye":
            headers.append((b"connection", b"close"))
        if path == "/split":
            headers.append((b"x-bad", b"a\r\nset-cookie: evil=1"))
        body = b'{"path":"%s","query":"%s","body":"%s","client":%s,"x":"%s"}' % (
            path.encode(), scope["query_string"], request["body"], b"true" if scope["client"] else b"false",
            dict(scope["headers"]).get(b"x-thing", b""))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def too_large(call: Call) -> Reply:
    return Reply(413, b'{"error":{"code":"payload_too_large"}}', [("content-type", "application/json")])


def run(scenario) -> None:
    async def main() -> None:
        app = App()
        front = Front(AsgiHandler(app, too_large), LIMIT, cancel_on_disconnect=False)
        await front.start("127.0.0.1", 0)
        try:
            await asyncio.wait_for(scenario(app, front), PATIENCE_S)
        finally:
            await front.close(grace_s=1)

    asyncio.run(main())


def test_whole_answers_keep_the_applications_headers_and_one_framing():
    async def scenario(app: App, front: Front) -> None:
        client = await Client.open(front)
        client.send("POST", "/echo?q=1", b"hello", headers=[("X-Thing", "yes")])
        response, body = await client.answer()
        assert response.status_code == 200
        assert body == b'{"path":"/echo","query":"q=1","body":"hello","client":true,"x":"yes"}'
        assert header(response, b"content-length") == str(len(body)).encode()  # not the application's 999
        assert [k for k, _ in response.headers].count(b"content-length") == 1
        assert header(response, b"content-type") == b"application/json"
        await client.goes_on()  # kept alive
        client.close()

    run(scenario)


def test_answers_in_parts_are_streamed_chunked():
    async def scenario(app: App, front: Front) -> None:
        client = await Client.open(front)
        client.send("GET", "/parts")
        response, body = await client.answer()
        assert response.status_code == 200 and body == b"one two three"
        assert header(response, b"transfer-encoding") == b"chunked"
        await client.goes_on()
        client.close()

    run(scenario)


def test_a_client_leaving_is_http_disconnect_and_the_handler_runs_on():
    async def scenario(app: App, front: Front) -> None:
        client = await Client.open(front)
        client.send("GET", "/wait")
        await app.waiting.wait()
        client.close()
        await app.gone.wait()
        assert app.events[-1] == "http.disconnect"

    run(scenario)


def test_connection_close_from_the_application_ends_the_connection():
    async def scenario(app: App, front: Front) -> None:
        client = await Client.open(front)
        client.send("GET", "/bye")
        response, _ = await client.answer()
        assert response.status_code == 200 and header(response, b"connection") == b"close"
        assert await client.closed()

    run(scenario)


def test_a_header_with_a_line_break_is_refused_and_the_server_serves_on():
    async def scenario(app: App, front: Front) -> None:
        client = await Client.open(front)
        client.send("GET", "/split")
        response, _ = await client.answer()
        assert response.status_code == 500
        assert header(response, b"set-cookie") is None and header(response, b"x-bad") is None
        other = await Client.open(front)
        await other.goes_on()
        other.close()

    run(scenario)


def test_an_oversized_body_gets_the_runtimes_413():
    async def scenario(app: App, front: Front) -> None:
        client = await Client.open(front)
        client.send("POST", "/echo", b"x" * (LIMIT + 1))
        response, body = await client.answer()
        assert response.status_code == 413 and b"payload_too_large" in body
        assert await client.closed()

    run(scenario)


def test_lifespan_runs_startup_and_shutdown_and_reports_a_failed_startup():
    async def scenario() -> None:
        app = App()
        lifespan = Lifespan(app)
        await lifespan.startup()
        await lifespan.shutdown()
        assert app.events == ["lifespan.startup", "lifespan.shutdown"]

        async def failing(scope, receive, send) -> None:
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "no model"})

        with pytest.raises(RuntimeError, match="no model"):
            await Lifespan(failing).startup()

        async def crashing(scope, receive, send) -> None:
            raise ValueError("broken app")

        with pytest.raises(ValueError, match="broken app"):
            await Lifespan(crashing).startup()

    asyncio.run(scenario())


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout():
    """`embedfleet serve` passes --keep-alive-seconds as the server's idle timeout."""

    async def scenario() -> None:
        front = Front(AsgiHandler(App(), too_large), LIMIT, idle_timeout_s=0.2, cancel_on_disconnect=False)
        await front.start("127.0.0.1", 0)
        try:
            client = await Client.open(front)
            client.send("GET", "/echo")
            assert (await client.answer())[0].status_code == 200
            assert await client.closed()
            assert not front.connections
        finally:
            await front.close(grace_s=1)

    asyncio.run(asyncio.wait_for(scenario(), PATIENCE_S))
