"""The gateway's lean client to replicas (gateway/wire.py), over real sockets to small asyncio servers.

What the proxy relies on: a kept-alive connection is reused; a connection the replica closed while
idle is not handed out, and one closed after the request was sent fails as `Disconnected` (so the
request goes elsewhere); refused connections fail as `ConnectFailed`; long and chunked answers stream
whole; the total time bounds the exchange; `connection: close` is honoured; the per-replica limit
holds; https gets TLS; a traced request carries its span's traceparent; a HEAD answer ends with its
head; a head is bounded. (The gateway's answers to replicas that misbehave: test_upstream_faults.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess

import pytest

from embedfleet.gateway.wire import UPSTREAM_TRACE, BadAnswer, ConnectFailed, Disconnected, WireClient


class Replica:
    """An HTTP/1.1 server on loopback that answers each request by `respond(request_bytes) -> bytes | None`
    (None: close without answering), and counts its connections."""

    def __init__(self, respond) -> None:
        self.respond = respond
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                answer = await self.respond(head + body)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if b"connection: close" in answer.lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        if self.server.is_serving():
            self.server.close()
            await self.server.wait_closed()


@contextlib.asynccontextmanager
async def serving(respond, **client_args):
    """A Replica answering by `respond`, its URL and a WireClient; both stopped on leaving."""
    replica = Replica(respond)
    url = await replica.start()
    client = WireClient(**client_args)
    try:
        yield replica, url, client
    finally:
        client.close()
        await replica.stop()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def fetch(client: WireClient, url: str, body: bytes = b'{"input":"x"}', total_s: float | None = 5.0):
    answer = await client.request(url, "POST", "/v1/embeddings", {"content-type": "application/json"}, body,
                                  total_s=total_s, connect_timeout=2.0)
    async with answer:
        return answer.status, answer.reason, answer.headers, await answer.read()


def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given():
    async def main():
        async def respond(_req):
            return ok(extra=b"x-embedfleet-expected-wait: 0.25\r\n")

        async with serving(respond) as (replica, url, client):
            for _ in range(5):
                status, reason, headers, body = await fetch(client, url)
                assert (status, reason, body) == (200, "OK", b'{"ok":true}')
                assert headers["X-Embedfleet-Expected-Wait"] == "0.25"
        assert replica.connections == 1
        first = replica.requests[0]
        assert first.startswith(b"POST /v1/embeddings HTTP/1.1\r\n")
        assert b"content-type: application/json\r\n" in first and first.endswith(b'{"input":"x"}')
        assert b"content-length: 13\r\n" in first and b"host: 127.0.0.1:" in first

    asyncio.run(main())


def test_a_connection_closed_while_idle_is_not_handed_out():
    async def main():
        async def respond(_req):
            return ok(extra=b"connection: close\r\n")

        async with serving(respond) as (replica, url, client):
            for _ in range(3):
                assert (await fetch(client, url))[0] == 200
        assert replica.connections == 3  # each answer said close: never reused

    asyncio.run(main())


def test_closed_before_answering_is_disconnected_and_refused_is_connect_failed():
    async def main():
        async def respond(_req):
            return None  # read the request, then close

        async with serving(respond) as (replica, url, client):
            with pytest.raises(Disconnected):
                await fetch(client, url)
            await replica.stop()
            with pytest.raises(ConnectFailed):
                await fetch(client, url)

    asyncio.run(main())


def test_a_stale_kept_alive_connection_fails_as_disconnected_then_a_fresh_one_works():
    async def main():
        served = 0

        async def respond(_req):
            nonlocal served
            served += 1
            return ok() if served != 2 else None  # the second request finds the connection closing

        async with serving(respond) as (replica, url, client):
            assert (await fetch(client, url))[0] == 200
            with pytest.raises(Disconnected):
                await fetch(client, url)
            assert (await fetch(client, url))[0] == 200
        assert replica.connections == 2

    asyncio.run(main())


def test_long_and_chunked_answers_stream_whole():
    big = bytes(range(256)) * 8192  # 2 MiB: past the pause threshold, so back-pressure is exercised

    async def main():
        async def respond(req):
            if b"chunked" in req:
                parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in (b"hello ", b"chunked ", b"world")]
                return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"".join(parts) + b"0\r\n\r\n"
            return ok(big)

        async with serving(respond) as (replica, url, client):
            status, _, _, body = await fetch(client, url)
            assert status == 200 and body == big
            answer = await client.request(url, "POST", "/x", {}, b"chunked", total_s=5, connect_timeout=2)
            async with answer:
                assert answer.content_length is None
                pieces = [p async for p in answer.iter_any()]
            assert b"".join(pieces) == b"hello chunked world"
            assert (await fetch(client, url))[3] == big  # the same connection, still in step
        assert replica.connections == 1

    asyncio.run(main())


def test_the_total_time_bounds_the_exchange_and_garbage_is_a_bad_answer():
    async def main():
        async def respond(req):
            if b"slow" in req:
                await asyncio.sleep(5)
                return ok()
            return b"SSH-2.0-OpenSSH\r\n\r\n"

        async with serving(respond) as (_replica, url, client):
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await fetch(client, url, b"slow", total_s=0.3)
            assert asyncio.get_running_loop().time() - started < 3
            with pytest.raises(BadAnswer):
                await fetch(client, url)

    asyncio.run(main())


def test_the_per_replica_limit_holds_and_waiters_get_the_released_connection():
    async def main():
        gate = asyncio.Event()

        async def respond(_req):
            await gate.wait()
            return ok()

        async with serving(respond, limit_per_host=2) as (replica, url, client):
            tasks = [asyncio.create_task(fetch(client, url)) for _ in range(5)]
            for _ in range(1000):  # until both allowed connections are open (10 s at most)
                if replica.connections >= 2:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # time for a third, were the limit not held
            assert replica.connections == 2  # the other three wait for one of these
            gate.set()
            results = await asyncio.gather(*tasks)
            assert [r[0] for r in results] == [200] * 5
        assert replica.connections == 2

    asyncio.run(main())


def _self_signed(tmp_path):
    """A certificate for 127.0.0.1 and its key, made by openssl."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_https_targets_get_tls_and_a_certificate_not_trusted_is_a_connect_failure(tmp_path):
    cert, key = _self_signed(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def main():
        async def serve(reader, writer):
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    await reader.readexactly(13)
                    writer.write(ok())
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=served)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = WireClient(tls=trusting)
        try:
            for _ in range(2):
                assert (await fetch(client, url))[0] == 200
            (pool,) = client.pools.values()
            assert pool.open == 1 and pool.host_header == url.removeprefix("https://")
            with pytest.raises(ConnectFailed):  # the system's CAs do not know this certificate
                await fetch(WireClient(), url)
        finally:
            client.close()
            server.close()

    asyncio.run(main())


class Spans:
    """A stand-in for tracing.py's spans: records what the client tells it, injects a traceparent."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def start(self, method, url, host, port, headers):
        headers["traceparent"] = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        self.events.append(("start", method, url, host, port))
        return len(self.events)

    def end(self, handle, status):
        self.events.append(("end", handle, status))

    def failed(self, handle, error):
        self.events.append(("failed", handle, type(error).__name__))


def test_a_traced_request_carries_its_span_and_an_untraced_one_nothing():
    async def main():
        async def respond(_req):
            return ok()

        async with serving(respond) as (replica, url, client):
            assert (await fetch(client, url))[0] == 200
            spans = Spans()
            hook = UPSTREAM_TRACE.set(spans)
            try:
                headers = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
                answer = await client.request(url, "POST", "/v1/embeddings?x=1", headers, b"{}", total_s=5,
                                              connect_timeout=2)
                async with answer:
                    await answer.read()
                await replica.stop()
                with pytest.raises(ConnectFailed):
                    await fetch(WireClient(), url)
            finally:
                UPSTREAM_TRACE.reset(hook)
        port = int(url.rsplit(":", 1)[1])
        assert spans.events == [("start", "POST", f"{url}/v1/embeddings", "127.0.0.1", port), ("end", 1, 200),
                                ("start", "POST", f"{url}/v1/embeddings", "127.0.0.1", port),
                                ("failed", 3, "ConnectFailed")]
        untraced, traced = replica.requests
        assert b"traceparent" not in untraced
        assert b"traceparent: 00-" + b"1" * 32 in traced and b"a" * 32 not in traced
        assert headers["traceparent"].startswith("00-aaa")  # the caller's headers are left as they were

    asyncio.run(main())


def test_a_head_answer_ends_with_its_head():
    async def main():
        async def respond(_req):
            return b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n"  # a HEAD answer: the length, no body

        async with serving(respond) as (_replica, url, client):
            answer = await client.request(url, "HEAD", "/v1/models", {}, b"", total_s=2, connect_timeout=2)
            async with answer:
                assert answer.status == 200 and await answer.read() == b""

    asyncio.run(main())


def test_an_endless_head_is_a_bad_answer():
    async def main():
        async def respond(_req):
            return b"HTTP/1.1 200 OK\r\n" + b"x-filler: 0123456789\r\n" * 10_000  # 220 KB, never ended

        async with serving(respond) as (_replica, url, client):
            with pytest.raises(BadAnswer, match="head over"):
                await fetch(client, url)

    asyncio.run(main())


def test_a_refused_header_takes_no_connection():
    """A header value with a line break is refused before a connection is taken: with one connection
    allowed, the next request still gets it."""
    async def main():
        async def respond(_req):
            return ok()

        async with serving(respond, limit_per_host=1) as (_replica, url, client):
            with pytest.raises(ValueError, match="line break"):
                await client.request(url, "POST", "/x", {"x-bad": "a\r\nb: c"}, b"{}", total_s=5, connect_timeout=2)
            assert (await asyncio.wait_for(fetch(client, url), 3))[0] == 200

    asyncio.run(main())
