"""Where the gateway's added latency at c=1 goes: the gateway beside minimal proxies, in one run.

The goal is at most 0.5 ms added at concurrency 1. This measures, against the same runtime and
one query at a time, what each layer of a Python proxy costs on this machine:

- `raw`: an asyncio protocol parsing with httptools both ways and passing bytes (no logic at all);
- `uvicorn_asgi`: uvicorn (httptools, uvloop) serving a bare ASGI app, the same raw upstream client;
- `aiohttp_server`: aiohttp's low-level `web.Server` (no application, no router), the same client;
- `aiohttp_app`: an aiohttp `web.Application` with one catch-all route, the same client;
- `gateway`: `embedfleet gateway` as a user starts it.

Each figure is the median of paired differences (a query through the proxy minus a query straight to
the runtime, alternating which goes first), so drift in the runtime's own time cancels out. Prints one
JSON line, also appended to bench/results/gateway-floor-cpu.jsonl.

    python bench/gateway_floor.py [--pairs 1500]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from _common import ROOT, SOURCE_PATHS, Server, add_results_dir, free_port, record
from gateway import QUERY, Gateway, cpu_name

VARIANTS = ("raw", "uvicorn_asgi", "aiohttp_server", "aiohttp_app")
DROP = {b"content-length", b"date", b"server", b"connection"}


# -- the minimal proxies (each runs as `python bench/gateway_floor.py --proxy VARIANT PORT UPSTREAM_PORT`)


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to the runtime, one request at a time (no error handling: a bench)."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.future: asyncio.Future | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        answer = (self.parser.get_status_code(), self.headers, b"".join(self.body))
        self.headers, self.body = [], []
        future, self.future = self.future, None
        future.set_result(answer)


class _Client:
    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[_Upstream] = []

    async def post(self, path: bytes, body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        loop = asyncio.get_running_loop()
        while self.idle and self.idle[-1].transport.is_closing():  # the runtime closed an idle one
            self.idle.pop()
        up = self.idle.pop() if self.idle else (await loop.create_connection(_Upstream, "127.0.0.1", self.port))[1]
        up.future = loop.create_future()
        up.transport.write(b"POST %s HTTP/1.1\r\nhost: runtime\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (path, len(body), body))
        answer = await up.future
        self.idle.append(up)
        return answer


def _raw(port: int, client: _Client) -> None:
    import httptools
    import uvloop

    class Front(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []
            self.url = b""

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_url(self, url: bytes) -> None:
            self.url = url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            asyncio.get_running_loop().create_task(self.forward(self.url, body))

        async def forward(self, url: bytes, body: bytes) -> None:
            status, headers, answer = await client.post(url, body)
            head = b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers if k.lower() not in DROP)
            self.transport.write(b"HTTP/1.1 %d OK\r\n%scontent-length: %d\r\n\r\n%s"
                                 % (status, head, len(answer), answer))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Front, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


def _uvicorn_asgi(port: int, client: _Client) -> None:
    import uvicorn

    async def app(scope, receive, send) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        status, headers, answer = await client.post(scope["raw_path"], b"".join(chunks))
        out = [(k, v) for k, v in headers if k.lower() not in DROP] + [(b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": answer})

    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", log_level="warning",
                access_log=False, lifespan="off")


def _aiohttp(port: int, client: _Client, application: bool) -> None:
    import uvloop
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        status, headers, answer = await client.post(request.raw_path.encode(), await request.read())
        return web.Response(body=answer, status=status,
                            headers=[(k.decode(), v.decode()) for k, v in headers if k.lower() not in DROP])

    async def main() -> None:
        if application:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            runner: web.BaseRunner = web.AppRunner(app, access_log=None)
        else:
            runner = web.ServerRunner(web.Server(handle, access_log=None))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def run_proxy(variant: str, port: int, upstream_port: int) -> None:
    client = _Client(upstream_port)
    if variant == "raw":
        _raw(port, client)
    elif variant == "uvicorn_asgi":
        _uvicorn_asgi(port, client)
    else:
        _aiohttp(port, client, application=variant == "aiohttp_app")


# -- the measurement


def paired_ms(direct_port: int, via_port: int, pairs: int, warmup: int = 50) -> float:
    body = json.dumps({"input": QUERY}).encode()
    headers = {"content-type": "application/json"}
    direct = http.client.HTTPConnection("127.0.0.1", direct_port)
    via = http.client.HTTPConnection("127.0.0.1", via_port)

    def one(conn: http.client.HTTPConnection) -> float:
        started = time.perf_counter()
        conn.request("POST", "/v1/embeddings", body, headers)
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data
        return time.perf_counter() - started

    for _ in range(warmup):
        one(direct), one(via)
    diffs = []
    for i in range(pairs):
        if i % 2:
            d = one(direct)
            v = one(via)
        else:
            v = one(via)
            d = one(direct)
        diffs.append(v - d)
    direct.close(), via.close()
    return statistics.median(diffs) * 1000


def listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"a proxy exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}")


def measure(pairs: int) -> dict:
    server = Server()
    procs: list[subprocess.Popen] = []
    try:
        direct_port = server.port
        ports = {}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*SOURCE_PATHS, str(ROOT / "bench")]))
        for variant in VARIANTS:
            ports[variant] = free_port()
            procs.append(subprocess.Popen([sys.executable, __file__, "--proxy", variant, str(ports[variant]),
                                           str(direct_port)], env=env, cwd=ROOT))
        gateway = Gateway(server.url)
        try:
            for variant, proc in zip(VARIANTS, procs, strict=True):
                listening(ports[variant], proc)
            added = {variant: round(paired_ms(direct_port, ports[variant], pairs), 3) for variant in VARIANTS}
            added["gateway"] = round(paired_ms(direct_port, gateway.port, pairs), 3)
        finally:
            gateway.stop()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        server.stop()
    return {"figure": "gateway_floor", "cpus": os.cpu_count(), "cpu": cpu_name(), "pairs": pairs, "added_p50_ms": added,
            "goal_ms": 0.5, "gateway_minus_aiohttp_app_ms": round(added["gateway"] - added["aiohttp_app"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=1500, help="paired queries per proxy")
    p.add_argument("--proxy", nargs=3, metavar=("VARIANT", "PORT", "UPSTREAM_PORT"), help=argparse.SUPPRESS)
    add_results_dir(p, "gateway-floor-cpu.jsonl")
    a = p.parse_args()
    if a.proxy:
        run_proxy(a.proxy[0], int(a.proxy[1]), int(a.proxy[2]))
        return
    row = measure(a.pairs)
    print(json.dumps(row))
    record("gateway-floor", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
