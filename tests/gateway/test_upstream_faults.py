"""Replicas that misbehave at the HTTP level, and what the gateway answers its client.

Each fake replica is a raw-socket asyncio server (on a thread of this test process) that answers the
gateway's polls (`GET /load`, `GET /v1/models`) as a runtime does and every work request (`POST`) in its
own broken way: closing or resetting the connection part way, dripping the answer byte by byte, a
malformed status line or header, a Content-Length longer than the body, broken chunked coding, an
endless body or head, closing kept-alive connections while idle or just as a request arrives, refusing
connections. One real `embedfleet gateway` process fronts them all, one deployment per fault. (The
same cases decided the gateway's upstream client: docs/gateway.md.)

The gateway must answer each with a correct answer (what the replica sent, when it was valid and
whole), or a clear 502/503/504 in its own error shape, or, once it has begun passing an answer on, an
answer that breaks off (never a truncated one passed off as complete); must never buffer an answer
without bound; and must go on serving.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

from tests.gateway.conftest import GatewayServer, wait_for
from tests.procs import ROOT, child_env, free_port, spawn

GOOD = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}]}'
HUGE_CAP = 256 << 20  # a fake stops sending an endless answer here (a gateway that buffers it still shows)
BOUND = 64 << 20  # what loopback socket buffers and the gateway may hold of an answer nobody reads


def answer(body: bytes = GOOD, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status, len(body), extra, body)


@dataclass
class Fake:
    """One replica: `mode` says how it answers a POST."""

    mode: str
    expected_wait: float = 0.0
    server: asyncio.AbstractServer | None = None
    port: int = 0
    posts: int = 0  # work requests received
    sent: int = 0  # bytes of answers to work requests the kernel took
    work_open: int = 0  # connections that carried work and are still open
    per_conn: dict[int, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Fakes:
    """The fake replicas, on an event loop of their own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fakes: dict[str, Fake] = {}

    def add(self, name: str, mode: str, expected_wait: float = 0.0) -> Fake:
        fake = Fake(mode, expected_wait)
        self.fakes[name] = fake

        async def start() -> None:
            fake.server = await asyncio.start_server(lambda r, w: self._serve(fake, r, w), "127.0.0.1", 0)
            fake.port = fake.server.sockets[0].getsockname()[1]

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return fake

    def stop_listening(self, fake: Fake) -> None:
        """New connections are refused from now on; open ones (the gateway's polls) go on."""
        async def close() -> None:
            assert fake.server is not None
            fake.server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)

    def close(self) -> None:
        for fake in self.fakes.values():
            if fake.server is not None:
                self.loop.call_soon_threadsafe(fake.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = id(writer)
        fake.per_conn[conn] = 0
        worked = False
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                                  0.3 if fake.mode == "idle_close" and fake.per_conn[conn] else None)
                except TimeoutError:  # idle: close it, as a replica with a short keep-alive does
                    return
                lines = head.split(b"\r\n")
                method, path = lines[0].split(b" ")[:2]
                length = next((int(line.split(b":", 1)[1]) for line in lines
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if method == b"GET":
                    writer.write(self._poll(fake, path))
                    await writer.drain()
                    continue
                if not worked:
                    worked = True
                    fake.work_open += 1
                fake.posts += 1
                fake.per_conn[conn] += 1
                if not await self._work(fake, conn, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            if worked:
                fake.work_open -= 1
            writer.close()

    @staticmethod
    def _poll(fake: Fake, path: bytes) -> bytes:
        if path == b"/load":
            doc = {"ready": True, "status": "ready", "models": {"m": {"expected_wait_s": fake.expected_wait}}}
        elif path == b"/v1/models":
            doc = {"object": "list", "data": [{"id": "m", "object": "model"}]}
        else:
            return answer(b'{"status":"ready"}')
        return answer(orjson.dumps(doc))

    async def _write(self, fake: Fake, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        fake.sent += len(data)

    async def _work(self, fake: Fake, conn: int, writer: asyncio.StreamWriter) -> bool:
        """Answer one work request in `fake.mode`'s way; False: the connection is done."""
        mode = fake.mode
        if mode in ("good", "idle_close"):
            await self._write(fake, writer, answer())
        elif mode == "close_on_second":  # the replica's idle close racing the request, on every reused one
            if fake.per_conn[conn] > 1:
                return False
            await self._write(fake, writer, answer())
        elif mode == "close_mid_head":
            await self._write(fake, writer, b"HTTP/1.1 200 OK\r\ncontent-ty")
            return False
        elif mode in ("close_mid_body", "reset_mid_body"):  # a Content-Length longer than what comes
            await self._write(fake, writer, b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 100)
            await asyncio.sleep(0.05)
            if mode == "reset_mid_body":
                _reset(writer)
            return False
        elif mode == "close_mid_stream":  # long enough to be streamed on, then gone part way
            await self._write(fake, writer, b"HTTP/1.1 200 OK\r\ncontent-length: 4194304\r\n\r\n")
            await self._write(fake, writer, b"x" * (512 << 10))
            await asyncio.sleep(0.2)
            return False
        elif mode == "reset":
            _reset(writer)
            return False
        elif mode == "drip":  # a valid answer, one byte every 3 ms
            for byte in answer():
                await self._write(fake, writer, bytes((byte,)))
                await asyncio.sleep(0.003)
        elif mode == "drip_head":  # so slow the request's deadline passes before the head is in
            for byte in answer():
                await self._write(fake, writer, bytes((byte,)))
                await asyncio.sleep(0.3)
        elif mode == "bad_status":
            await self._write(fake, writer, b"HTTP/1.1 2x0 OK\r\ncontent-length: 2\r\n\r\n{}")
        elif mode == "bad_header":
            await self._write(fake, writer, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nno colon here\r\n\r\n{}")
        elif mode == "bad_chunked":
            await self._write(fake, writer, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n")
            await asyncio.sleep(0.2)
            return False
        elif mode == "bad_chunked_later":
            await self._write(fake, writer, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await asyncio.sleep(0.2)
            await self._write(fake, writer, b"zz\r\nworld\r\n")
            await asyncio.sleep(0.2)
            return False
        elif mode == "endless_head":  # header lines that never end
            await self._write(fake, writer, b"HTTP/1.1 200 OK\r\n")
            while fake.sent < HUGE_CAP:
                await self._write(fake, writer, b"x-filler: 0123456789\r\n" * 512)
            await asyncio.sleep(3600)
        elif mode in ("endless_body", "endless_503", "endless_chunked"):  # more than any sane bound
            status = b"503 Service Unavailable" if mode == "endless_503" else b"200 OK"
            framing = b"transfer-encoding: chunked" if mode == "endless_chunked" else b"content-length: 68719476736"
            await self._write(fake, writer, b"HTTP/1.1 %s\r\n%s\r\n\r\n" % (status, framing))
            block = b"x" * (64 << 10)
            if mode == "endless_chunked":
                block = b"%x\r\n%s\r\n" % (len(block), block)
            while fake.sent < HUGE_CAP:
                await self._write(fake, writer, block)
            await asyncio.sleep(3600)
        return True


MODES = ("good", "idle_close", "close_on_second", "close_mid_head", "close_mid_body", "reset_mid_body",
         "close_mid_stream", "reset", "drip", "drip_head", "bad_status", "bad_header", "bad_chunked",
         "bad_chunked_later", "endless_head", "endless_body", "endless_503", "endless_chunked", "refused")


@dataclass
class Scene:
    fakes: Fakes
    gateway: GatewayServer

    def post(self, model: str, timeout: float = 30, **headers: str) -> httpx.Response:
        return httpx.post(f"{self.gateway.url}/v1/embeddings", json={"model": model, "input": "x"},
                          headers=headers, timeout=timeout)

    def still_serving(self) -> None:
        assert self.gateway.proc.poll() is None
        r = self.post("good")
        assert r.status_code == 200 and r.content == GOOD

    def rss(self) -> int:
        with open(f"/proc/{self.gateway.proc.pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def scene():
    fakes = Fakes()
    for mode in MODES:
        fakes.add(mode, mode)
    # failover: a replica that refuses connections, preferred (it reports no wait), and a good one
    fakes.add("failover_refused", "good")
    fakes.add("failover_good", "good", expected_wait=0.5)
    upstreams = [f"{name}=http://127.0.0.1:{fake.port}" for name, fake in fakes.fakes.items()
                 if not name.startswith("failover")]
    upstreams += [f"failover={fakes.fakes[name].url}" for name in ("failover_refused", "failover_good")]
    port = free_port()
    cmd = [sys.executable, "-m", "embedfleet.runtime.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
           "--hold-timeout", "3", "--poll-interval", "30", "--eject-after", "0",
           *[f for u in upstreams for f in ("--upstream", u)]]
    log = tempfile.NamedTemporaryFile(prefix="embedfleet-gateway-faults-", suffix=".log", delete=False)
    proc = spawn(cmd, stdout=log, stderr=log, cwd=ROOT, env=child_env())
    gateway = GatewayServer(proc, port, Path(log.name))
    try:
        gateway.wait_ready(timeout=60)
        wait_for(lambda: all(d["ready_replicas"] == d["replicas"] for d in gateway.load().values()),
                 "every fake replica polled ready")
        yield Scene(fakes, gateway)
    finally:
        gateway.stop()
        fakes.close()


def refused_with(r: httpx.Response, statuses: tuple[int, ...], codes: tuple[str, ...] | None = None) -> None:
    """The gateway's own error answer: one of `statuses`, its JSON error shape, one of `codes`."""
    assert r.status_code in statuses, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["message"], error
    if codes is not None:
        assert error["code"] in codes, error


def test_a_valid_answer_passes_whole(scene: Scene) -> None:
    r = scene.post("good")
    assert r.status_code == 200 and r.content == GOOD


def test_an_answer_dripped_byte_by_byte_passes_whole(scene: Scene) -> None:
    r = scene.post("drip")
    assert r.status_code == 200 and r.content == GOOD
    scene.still_serving()


def test_a_head_slower_than_the_deadline_is_a_504(scene: Scene) -> None:
    started = time.monotonic()
    r = scene.post("drip_head", **{"x-request-timeout": "0.5"})
    refused_with(r, (504,), ("upstream_timeout",))
    assert time.monotonic() - started < 10
    scene.still_serving()


@pytest.mark.parametrize(("mode", "codes"), [
    ("close_mid_head", None),
    ("close_mid_body", ("upstream_broke_off",)),
    ("reset_mid_body", ("upstream_broke_off",)),
    ("bad_status", ("bad_gateway",)),
    ("bad_header", ("bad_gateway",)),
    ("bad_chunked", ("upstream_broke_off",)),
    ("reset", ("upstream_unavailable",)),
])
def test_a_broken_answer_is_a_502(scene: Scene, mode: str, codes: tuple[str, ...] | None) -> None:
    refused_with(scene.post(mode), (502,), codes)
    scene.still_serving()


@pytest.mark.parametrize("mode", ["close_mid_stream", "bad_chunked_later"])
def test_an_answer_broken_after_it_began_breaks_off_at_the_client(scene: Scene, mode: str) -> None:
    """Once part of an answer went on, the client's answer breaks off too: never ends as if complete."""
    with pytest.raises(httpx.RemoteProtocolError):
        scene.post(mode)
    scene.still_serving()


def test_connections_the_replica_closed_while_idle_are_not_used(scene: Scene) -> None:
    for _ in range(3):
        r = scene.post("idle_close")
        assert r.status_code == 200 and r.content == GOOD
        time.sleep(0.6)  # the fake closes an idle connection after 0.3 s


def test_a_kept_alive_connection_closed_as_the_request_arrives_is_retried_on_a_fresh_one(scene: Scene) -> None:
    """The replica closes every reused connection without answering (its idle close racing the request):
    the request was never taken, so the client gets the answer from a fresh connection."""
    for _ in range(4):
        r = scene.post("close_on_second")
        assert r.status_code == 200 and r.content == GOOD
    assert scene.fakes.fakes["close_on_second"].posts > 4  # some went down a connection that closed


def test_a_refused_connection_fails_over_to_another_replica(scene: Scene) -> None:
    scene.fakes.stop_listening(scene.fakes.fakes["failover_refused"])
    before = scene.gateway.count("embedfleet_gateway_retries_total", deployment="failover", reason="connect")
    r = scene.post("failover")
    assert r.status_code == 200 and r.content == GOOD
    assert scene.gateway.count("embedfleet_gateway_retries_total", deployment="failover", reason="connect") > before


def test_a_refused_connection_with_no_other_replica_is_a_clear_refusal(scene: Scene) -> None:
    scene.fakes.stop_listening(scene.fakes.fakes["refused"])
    refused_with(scene.post("refused"), (502, 503), ("upstream_unavailable", "cold_start"))
    scene.still_serving()


def _unread(scene: Scene, model: str) -> bytes:
    """Send a request on a raw socket that reads no more than the answer's head, for 3 s; the head."""
    body = orjson.dumps({"model": model, "input": "x"})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.settimeout(20)
    sock.connect(("127.0.0.1", scene.gateway.port))
    try:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        head = sock.recv(1024)
        time.sleep(3)
        return head
    finally:
        sock.close()


@pytest.mark.parametrize("mode", ["endless_body", "endless_chunked", "endless_503"])
def test_an_endless_answer_is_passed_on_with_back_pressure_never_buffered(scene: Scene, mode: str) -> None:
    """A client that does not read: the gateway stops reading the replica (what it holds is bounded by
    socket buffers), and once the client leaves it lets the replica go."""
    fake = scene.fakes.fakes[mode]
    rss = scene.rss()
    head = _unread(scene, mode)
    assert head.startswith(b"HTTP/1.1 200" if mode != "endless_503" else b"HTTP/1.1 503"), head
    assert fake.sent < BOUND, f"the gateway took {fake.sent >> 20} MiB of an answer its client did not read"
    assert scene.rss() - rss < BOUND
    wait_for(lambda: fake.work_open == 0, "the gateway to close the replica's connection", timeout=20)
    scene.still_serving()


def test_an_endless_head_is_a_502_after_a_bounded_read(scene: Scene) -> None:
    fake = scene.fakes.fakes["endless_head"]
    refused_with(scene.post("endless_head"), (502,), ("bad_gateway",))
    assert fake.sent < BOUND
    wait_for(lambda: fake.work_open == 0, "the gateway to close the replica's connection", timeout=20)
    scene.still_serving()
