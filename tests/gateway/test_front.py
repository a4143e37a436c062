"""The gateway's HTTP/1.1 server (front.py), over real loopback sockets, read by h11 (httpx's own
parser) so that our framing is checked by an independent implementation.

What the gateway relies on: keep-alive and pipelined requests answered in order; bodies by length or
chunked, and an oversized one handed on marked (never read whole) with the connection closed after the
refusal, which the client still reads in full; `Expect: 100-continue`; malformed requests and huge
heads refused and the server still serving; a handler cancelled when its client leaves; streamed
answers framed for HTTP/1.1 (chunked) and 1.0 (to the close); HEAD without a body; a handler's crash a
500; `close()` ending idle connections at once and busy ones after their answer.
"""

from __future__ import annotations

import asyncio
import contextlib

import h11
import orjson
import pytest

from embedfleet.front import Call, Front, Reply, json_reply

LIMIT = 1000
PATIENCE_S = 20  # how long a test waits for what must happen: only so that a broken server cannot hang it


class Echo:
    """A handler: says what it got; `/slow` waits for `release`, `/stream` streams three parts, `/crash` raises."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.entered = asyncio.Event()

    async def __call__(self, call: Call):
        self.calls.append(call)
        if call.path == "/slow":
            self.entered.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if call.path == "/crash":
            raise RuntimeError("boom")
        if call.path == "/stream":
            length = int(call.query["length"]) if "length" in call.query else None
            stream = call.stream(200, None, [("content-type", "text/plain")], length)
            for part in (b"one ", b"two ", b"three"):
                await stream.write(part)
                await asyncio.sleep(0)
            await stream.end()
            return stream
        return json_reply({"method": call.method, "path": call.path, "raw_path": call.raw_path,
                           "query": dict(call.query), "body": call.body.decode(), "oversized": call.oversized,
                           "x": call.headers.get("x-thing")})


async def started(handler) -> Front:
    front = Front(handler, LIMIT)
    await front.start("127.0.0.1", 0)
    return front


class Client:
    """One connection, requests and answers through h11."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, version: bytes = b"1.1") -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, front: Front) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", front.port))

    def send(self, method: str, target: str, body: bytes | None = None, headers=(), chunked: bool = False) -> None:
        head = [("host", "gw"), *headers]
        if body is not None:
            head.append(("transfer-encoding", "chunked") if chunked else ("content-length", str(len(body))))
        data = self.h11.send(h11.Request(method=method, target=target, headers=head))
        if body is not None:
            data += self.h11.send(h11.Data(data=body))
        data += self.h11.send(h11.EndOfMessage())
        self.writer.write(data)

    def sent_raw(self, method: str, target: str) -> None:
        """A body-less request was written as raw bytes: h11 must know of it to read its answer."""
        self.h11.send(h11.Request(method=method, target=target, headers=[("host", "gw")]))
        self.h11.send(h11.EndOfMessage())

    async def answer(self) -> tuple[h11.Response, bytes]:
        response, body = None, b""
        while True:
            event = self.h11.next_event()
            if event is h11.PAUSED:
                raise AssertionError(f"h11 paused: {self.h11.states}")
            if event is h11.NEED_DATA:
                self.h11.receive_data(await asyncio.wait_for(self.reader.read(65536), PATIENCE_S))
                continue
            if isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    with contextlib.suppress(h11.LocalProtocolError):
                        self.h11.start_next_cycle()
                return response, body
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("closed before an answer")

    async def closed(self) -> bool:
        """Does the server close the connection (EOF, not more bytes)?"""
        try:
            return await asyncio.wait_for(self.reader.read(1), PATIENCE_S) == b""
        except (ConnectionError, TimeoutError):
            return False

    async def goes_on(self) -> None:
        """The connection still serves: a plain request is answered on it."""
        self.send("GET", "/after")
        assert (await self.answer())[0].status_code == 200

    def close(self) -> None:
        self.writer.close()


async def still_serving(front: Front) -> None:
    """The server answers a new connection."""
    other = await Client.open(front)
    await other.goes_on()
    other.close()


def header(response: h11.Response, name: bytes) -> bytes | None:
    return next((v for k, v in response.headers if k == name), None)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 3 * PATIENCE_S))


def test_keep_alive_requests_are_answered_on_one_connection() -> None:
    async def main() -> None:
        handler = Echo()
        front = await started(handler)
        client = await Client.open(front)
        for i in range(3):
            client.send("POST", f"/v1/embeddings?n={i}&model=a%20b", orjson.dumps({"i": i}), [("x-thing", "t")])
            response, body = await client.answer()
            doc = orjson.loads(body)
            assert response.status_code == 200 and header(response, b"content-type") == b"application/json"
            assert doc["body"] == f'{{"i":{i}}}' and doc["query"] == {"n": str(i), "model": "a b"}
            assert doc["raw_path"] == f"/v1/embeddings?n={i}&model=a%20b" and doc["x"] == "t"
            assert header(response, b"connection") is None
        assert len(front.connections) == 1
        client.close()
        await front.close()

    run(main())


def test_pipelined_requests_are_answered_in_order() -> None:
    async def main() -> None:
        handler = Echo()
        front = await started(handler)
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: gw\r\n\r\nGET /second HTTP/1.1\r\nhost: gw\r\n\r\n")
        await handler.entered.wait()  # both requests came in one write, so both are parsed by now
        for _ in range(5):  # turns in which a wrongly started second handler would run
            await asyncio.sleep(0)
        assert [c.path for c in handler.calls] == ["/slow"], "the second waits for the first's answer"
        handler.release.set()
        client = Client(reader, writer)
        client.sent_raw("GET", "/slow")
        first = await client.answer()
        client.sent_raw("GET", "/second")
        second = await client.answer()
        assert orjson.loads(first[1])["path"] == "/slow" and orjson.loads(second[1])["path"] == "/second"
        client.close()
        await front.close()

    run(main())


def test_chunked_body_within_the_limit_is_read_whole() -> None:
    async def main() -> None:
        front = await started(Echo())
        client = await Client.open(front)
        client.send("POST", "/x", b"a" * 600, chunked=True)
        response, body = await client.answer()
        assert response.status_code == 200 and orjson.loads(body)["body"] == "a" * 600
        client.close()
        await front.close()

    run(main())


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_an_oversized_body_is_handed_on_marked_and_the_connection_ends_after_the_answer(chunked: bool) -> None:
    async def main() -> None:
        handler = Echo()
        front = await started(handler)
        client = await Client.open(front)
        body = b"z" * (LIMIT * 200)  # 200 KB: more than a socket buffer, still being sent while refused
        client.send("POST", "/x", body, chunked=chunked)
        response, answer = await client.answer()
        doc = orjson.loads(answer)
        assert response.status_code == 200 and doc["body"] == ""
        assert doc["oversized"] == (-1 if chunked else len(body))
        assert header(response, b"connection") == b"close"
        assert await client.closed()
        client.close()
        await still_serving(front)
        await front.close()

    run(main())


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def main() -> None:
        front = await started(Echo())
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"POST /x HTTP/1.1\r\nhost: gw\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), PATIENCE_S)
        assert interim.startswith(b"HTTP/1.1 100 ")
        writer.write(b"hello")
        client = Client(reader, writer)
        client.h11.send(h11.Request(method="POST", target="/x", headers=[("host", "gw"), ("content-length", "5")]))
        client.h11.send(h11.Data(data=b"hello"))
        client.h11.send(h11.EndOfMessage())
        response, body = await client.answer()
        assert response.status_code == 200 and orjson.loads(body)["body"] == "hello"
        writer.close()
        await front.close()

    run(main())


@pytest.mark.parametrize(("data", "status", "code"), [
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "bad_request"),
    (b"GET / HTTP/1.1\r\nhost: gw\r\nx-big: " + b"y" * 70_000 + b"\r\n\r\n", 431, "head_too_large"),
], ids=["malformed", "huge-head"])
def test_bytes_that_are_no_request_are_refused_and_the_server_keeps_serving(data: bytes, status: int,
                                                                             code: str) -> None:
    async def main() -> None:
        handler = Echo()
        front = await started(handler)
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(data)
        client = Client(reader, writer)
        client.sent_raw("GET", "/")
        response, body = await client.answer()
        assert response.status_code == status and orjson.loads(body)["error"]["code"] == code
        assert await client.closed() and handler.calls == []
        await still_serving(front)
        await front.close()

    run(main())


def test_a_client_that_leaves_cancels_its_handler() -> None:
    async def main() -> None:
        handler = Echo()
        front = await started(handler)
        client = await Client.open(front)
        client.send("GET", "/slow")
        await handler.entered.wait()
        client.writer.transport.abort()
        await asyncio.wait_for(handler.cancelled.wait(), PATIENCE_S)
        await front.close()

    run(main())


@pytest.mark.parametrize("length", [None, 13], ids=["unknown-length", "known-length"])
def test_a_streamed_answer_is_framed_for_http_1_1(length: int | None) -> None:
    async def main() -> None:
        front = await started(Echo())
        client = await Client.open(front)
        client.send("GET", "/stream" + ("" if length is None else f"?length={length}"))
        response, body = await client.answer()
        assert body == b"one two three"
        assert header(response, b"transfer-encoding") == (b"chunked" if length is None else None)
        await client.goes_on()
        client.close()
        await front.close()

    run(main())


def test_an_http_1_0_client_gets_a_streamed_answer_to_the_close() -> None:
    async def main() -> None:
        front = await started(Echo())
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), PATIENCE_S)  # to EOF
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
        assert body == b"one two three"
        writer.close()
        await front.close()

    run(main())


def test_head_has_no_body_and_connection_close_is_honoured() -> None:
    async def main() -> None:
        front = await started(Echo())
        client = await Client.open(front)
        client.send("HEAD", "/x")
        response, body = await client.answer()
        assert response.status_code == 200 and body == b"" and int(header(response, b"content-length")) > 0
        client.send("GET", "/x", headers=[("connection", "close")])
        response, _ = await client.answer()
        assert header(response, b"connection") == b"close" and await client.closed()
        await front.close()

    run(main())


def test_a_crashing_handler_is_a_500_and_the_connection_goes_on() -> None:
    async def main() -> None:
        front = await started(Echo())
        client = await Client.open(front)
        client.send("GET", "/crash")
        response, body = await client.answer()
        assert response.status_code == 500 and orjson.loads(body)["error"]["code"] == "internal_error"
        await client.goes_on()
        client.close()
        await front.close()

    run(main())


def test_close_ends_idle_connections_now_and_busy_ones_after_their_answer() -> None:
    async def main() -> None:
        handler = Echo()
        front = await started(handler)
        idle, busy = await Client.open(front), await Client.open(front)
        idle.send("GET", "/x")
        await idle.answer()
        busy.send("GET", "/slow")
        await handler.entered.wait()
        closing = asyncio.create_task(front.close())
        assert await idle.closed()
        assert not closing.done()
        handler.release.set()
        response, _ = await busy.answer()
        assert response.status_code == 200 and header(response, b"connection") == b"close"
        assert await busy.closed()
        await closing

    run(main())


def test_a_reply_with_no_body_status_has_no_length() -> None:
    async def main() -> None:
        async def no_content(call: Call) -> Reply:
            return Reply(204, b"", [("x-done", "1")])

        front = await started(no_content)
        client = await Client.open(front)
        client.send("DELETE", "/v1/jobs/1")
        response, body = await client.answer()
        assert response.status_code == 204 and body == b"" and header(response, b"content-length") is None
        client.close()
        await front.close()

    run(main())
