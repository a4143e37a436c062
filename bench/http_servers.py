"""embedfleet's HTTP server (httpserver.py: uvicorn, bounded) beside maintained servers, in one run.

The same trivial application (read the JSON body, answer a small JSON document) behind each server, each in
a process of its own on uvloop where the server allows:

- `embedfleet`: httpserver.py's server (uvicorn's httptools protocol with its bounds), the runtime's path;
- `embedfleet_calls`: the same serving a handler through calls.py (the gateway's path);
- `uvicorn_httptools`, `uvicorn_h11`: uvicorn as shipped, with either parser;
- `granian`: granian (Rust, hyper) serving the ASGI app, one worker, one runtime thread.

Figures: c=1 latency (median round trip over one kept-alive connection; variants interleaved in blocks so
drift on the machine falls on all alike) and throughput with 32 connections (a backfill's shape), each as a
ratio against `uvicorn_httptools`: what the bounds cost. bench/results/http-servers-cpu.jsonl also keeps the
figures of the hand-written server this replaced (docs/http.md). The abuse classes are the tests'
(tests/abuse); this measures speed only. One JSON line per server, then a summary line, all appended to
bench/results/http-servers-cpu.jsonl with one run_meta (the run's date tells them from other runs').

    python bench/http_servers.py [--requests 4000] [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import SOURCE_PATHS, add_results_dir, free_port, record, run_meta

VARIANTS = ("embedfleet", "embedfleet_calls", "uvicorn_httptools", "uvicorn_h11", "granian")
BASELINE = "uvicorn_httptools"
BODY = b'{"model":"m","input":"the quick brown fox jumps over the lazy dog"}'
REQUEST = (b"POST /v1/embeddings HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%b" % (len(BODY), BODY))
ANSWER = b'{"object":"list","data":[{"index":0}]}'


async def asgi_app(scope, receive, send) -> None:
    """The application: whole body read, a fixed small answer."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]})
    await send({"type": "http.response.body", "body": ANSWER})


app = asgi_app  # granian imports it as http_servers:app


def serve(variant: str, port: int) -> None:
    """Run one server in this process until killed."""
    import uvloop

    if variant.startswith("uvicorn"):
        import uvicorn

        uvicorn.run(asgi_app, host="127.0.0.1", port=port, http=variant.split("_")[1], loop="uvloop",
                    log_level="warning", access_log=False, lifespan="off")
        return

    async def main() -> None:
        from embedfleet.calls import CallApp, Reply
        from embedfleet.httpserver import Limits, server

        app = asgi_app
        if variant == "embedfleet_calls":
            async def handler(call):
                return Reply(200, ANSWER, [("content-type", "application/json")])
            app = CallApp(handler, 2 << 20)
        http = server(app, "127.0.0.1", port, Limits())
        await http.startup()
        await asyncio.Event().wait()

    uvloop.run(main())


def start(variant: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *SOURCE_PATHS]))
    if variant == "granian":
        cmd = [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1", "--runtime-threads", "1", "--loop", "uvloop", "--no-ws", "--log-level", "warning",
               "--no-access-log", "http_servers:app"]
    else:
        cmd = [sys.executable, __file__, "--serve", variant, str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(REQUEST)
                if s.recv(65536).startswith(b"HTTP/1.1 200"):
                    return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{variant} did not start")


def read_answer(sock: socket.socket, buf: bytearray) -> None:
    """One whole answer (Content-Length framed) off the socket; leftovers stay in `buf`."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end]).lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(buf) >= end + 4 + length:
                del buf[:end + 4 + length]
                return
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk


def latencies(port: int, n: int) -> list[float]:
    out = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        for _ in range(n):
            t0 = time.perf_counter()
            sock.sendall(REQUEST)
            read_answer(sock, buf)
            out.append(time.perf_counter() - t0)
    return out


async def throughput(port: int, seconds: float, connections: int = 32) -> float:
    done = 0
    stop = time.monotonic() + seconds

    async def client() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < stop:
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            at = head.lower().find(b"content-length:")
            await reader.readexactly(int(head[at + 15:].split(b"\r\n", 1)[0]))
            done += 1
        writer.close()

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(connections)))
    return done / (time.monotonic() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000, help="c=1 requests per server")
    parser.add_argument("--seconds", type=float, default=4.0, help="throughput window per server")
    parser.add_argument("--serve", nargs=2, metavar=("VARIANT", "PORT"), help=argparse.SUPPRESS)
    add_results_dir(parser, "http-servers-cpu.jsonl")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    servers = {v: start(v) for v in VARIANTS}
    try:
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for v in VARIANTS:
            latencies(servers[v][1], 300)  # warm-up
        block = 200
        for _ in range(max(1, args.requests // block)):
            for v in VARIANTS:
                samples[v] += latencies(servers[v][1], block)
        rates = {v: asyncio.run(throughput(servers[v][1], args.seconds)) for v in VARIANTS}
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait(10)
    p50 = {v: statistics.median(s) * 1000 for v, s in samples.items()}
    p99 = {v: statistics.quantiles(s, n=100)[98] * 1000 for v, s in samples.items()}
    rows = [{"figure": "http_servers", "server": v, "c1_p50_ms": round(p50[v], 4),
             "c1_p99_ms": round(p99[v], 4), "c32_req_per_s": round(rates[v]),
             "c1_p50_vs_uvicorn": round(p50[v] / p50[BASELINE], 3),
             "c32_vs_uvicorn": round(rates[v] / rates[BASELINE], 3)} for v in VARIANTS]
    rows.append({"figure": "http_servers_summary", "cpus": os.cpu_count(),
                 "bounds_cost_ms_at_c1": round(p50["embedfleet"] - p50[BASELINE], 4),
                 "calls_cost_ms_at_c1": round(p50["embedfleet_calls"] - p50["embedfleet"], 4)})
    meta = run_meta()  # one for the run: its rows share the date
    for row in rows:
        print(json.dumps(row))
        record("http-servers", row, results_dir=args.results_dir, meta=meta)


if __name__ == "__main__":
    main()
