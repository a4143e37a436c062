"""The single-query fast path: what the server adds to one short query at concurrency 1.

In-process: the TorchEngine on the default model (threads as `embedfleet serve` sets them), driven
from one dedicated thread as the server's engine thread is; one query is tokenize + embed. Server:
`embedfleet serve` in its own process, POST /v1/embeddings {"input": <the same query>} one at a time on
one keep-alive connection, from each of two clients: the standard library's http.client (httpx alone
adds about 0.8 ms per request on this machine, which is the client's cost, not the server's) and a
leaner one, a socket with httptools' response parser (http.client parses headers with the email
package, about 0.25 ms on cold caches). All are measured in interleaved rounds in one run, so that a
neighbour's load on a small machine shifts them alike; each sample is one query's wall time.

Prints one JSON line, also appended to bench/results/fastpath-cpu.jsonl: in-process p50, and by client the
server p50 and p99 as the client saw them, their difference (the overhead of HTTP, validation, thread hops
and encoding) and ratio, the server's own time for the request (`server-timing`, gate to answer) and the CPU.

The difference between two processes also holds the difference between their forward passes, which
on a small VM moves by a millisecond or more from one process start to the next: the same model,
the same thread count, another placement of its weights and threads. So the server's own split of
each query (server-timing: tokenize, queue, inference) gives a second figure, `overhead_same_process_ms`:
each query's client time less the forward pass the server timed for it, less the in-process
tokenization, as a median; the model's time then comes from the process that served the query.

And a floor, in the same run: a bare server on embedfleet's HTTP server (httpserver.py) whose handler hands a
pause as long as the in-process forward pass to a thread like the engine's (core/engine_thread.py) and
answers a canned embedding of the same size, with the same client. Its client time less its pause,
`floor_ms`, is what any Python server with an engine thread costs here (the client's send and read, the
loopback socket, two process wake-ups and a thread round trip, each on caches the pause left cold); the
server's own share is `overhead_same_process_ms` less that.
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
from concurrent.futures import ThreadPoolExecutor

import httptools
import numpy as np

from _common import SOURCE_PATHS, Server, add_results_dir, free_port, record
from embedfleet.gateway.upstreams import server_timing
from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import DEFAULT_MODEL_NAME, default_model_dir

QUERY = "how do I reset the password on my account from a phone"  # 11 words, 14 tokens with specials


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def percentile(samples: list[float], q: float) -> float:
    return round(float(np.percentile(np.array(samples) * 1000, q)), 3)


class InProcess:
    """The engine the server builds, on its own thread, with the server's tokenizer (no HTTP, no queue)."""

    def __init__(self) -> None:
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.spec = load_spec(default_model_dir(), DEFAULT_MODEL_NAME)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.engine = self.thread.submit(TorchEngine, self.spec, num_threads=cores).result()
        self.thread.submit(self.engine.warmup).result()
        self.tokenizer = TokenizerPool(self.spec.path / "tokenizer.json", 1)

    def _times(self, n: int, warmup: int, tokenizing: list[float]) -> list[float]:
        out = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            ids = self.tokenizer._encode_sync([QUERY], self.spec.max_length, True, "right")[0].ids
            t1 = time.perf_counter()
            self.engine.embed([ids])
            if i >= warmup:
                out.append(time.perf_counter() - t0)
                tokenizing.append(t1 - t0)
        return out

    def times(self, n: int, warmup: int, tokenizing: list[float]) -> list[float]:
        """Whole queries' times; each one's tokenization alone is appended to `tokenizing`."""
        return self.thread.submit(self._times, n, warmup, tokenizing).result()

    def close(self) -> None:
        self.tokenizer.close()
        self.thread.shutdown()


class StdClient:
    """The standard library's http.client: one keep-alive connection."""

    name = "http.client"

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, body: bytes) -> tuple[int, str | None, bytes]:
        self.conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
        r = self.conn.getresponse()
        return r.status, r.getheader("server-timing"), r.read()

    def close(self) -> None:
        self.conn.close()


class LeanClient:
    """A blocking socket and httptools' response parser (the C parser our gateway's client to replicas
    uses, gateway/wire.py): what is left of a client when its own header parsing is taken out.
    http.client parses headers with the email package, about 0.25 ms per answer on caches the wait
    left cold here, which is the client's time, not the server's."""

    name = "httptools"

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head = b"POST /v1/embeddings HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n" % port
        self._timing: bytes | None = None
        self._body: list[bytes] = []
        self._done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"server-timing":
            self._timing = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._done = True

    def post(self, body: bytes) -> tuple[int, str | None, bytes]:
        self.sock.sendall(self.head + b"content-length: %d\r\n\r\n" % len(body) + body)
        self._timing, self._body, self._done = None, [], False
        parser = httptools.HttpResponseParser(self)
        while not self._done:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            parser.feed_data(data)
        return parser.get_status_code(), self._timing.decode() if self._timing else None, b"".join(self._body)

    def close(self) -> None:
        self.sock.close()


CLIENTS = {"http.client": StdClient, "httptools": LeanClient}


def server_times(client: StdClient | LeanClient, n: int, warmup: int,
                 own: list[dict[str, float]] | None = None, check: bool = True) -> list[float]:
    """Whole queries' times as the client saw them; the server's split of each (server-timing, in
    seconds by part) is appended to `own`."""
    body = json.dumps({"input": QUERY}).encode()
    out = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        status, timing, data = client.post(body)
        elapsed = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"{status}: {data[:200]!r}")
        if i >= warmup:
            out.append(elapsed)
            if own is not None:
                own.append(server_timing(timing))
    assert len(json.loads(data)["data"][0]["embedding"]) == 384
    if check:
        assert json.loads(data)["model"] != "floor"
    return out


def floor_server(port: int, pause_s: float) -> None:
    """The floor (run as `fastpath.py --floor-server PORT PAUSE_S`): HTTP, one hand-off to an engine-like
    thread that sleeps `pause_s`, a canned answer the size of an embedding, `server-timing` inference."""
    import numpy as np
    import orjson
    import uvloop

    from embedfleet.calls import CallApp, Reply
    from embedfleet.httpserver import Limits, server
    from embedfleet.runtime.core.engine_thread import EngineThread

    body = orjson.dumps({"object": "list", "model": "floor", "data": [{"object": "embedding", "index": 0,
                        "embedding": np.random.default_rng(0).random(384, dtype=np.float32)}],
                         "usage": {"prompt_tokens": 14, "total_tokens": 14}}, option=orjson.OPT_SERIALIZE_NUMPY)
    engine = EngineThread("engine-floor")

    async def handler(call):
        if call.method == "GET":
            return Reply(200, b'{"status":"ready"}', [("content-type", "application/json")])
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def pause() -> None:
            started = time.perf_counter()
            time.sleep(pause_s)
            loop.call_soon_threadsafe(done.set_result, time.perf_counter() - started)

        engine.post(pause)
        took = await done
        return Reply(200, body, [("content-type", "application/json"),
                                 ("server-timing", f"total;dur={took * 1000:.3f}, inference;dur={took * 1000:.3f}")])

    async def main() -> None:
        http = server(CallApp(handler, 1 << 20), "127.0.0.1", port, Limits())
        await http.startup()
        await asyncio.Event().wait()

    uvloop.run(main())


class Floor:
    def __init__(self, pause_s: float) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS))
        self.proc = subprocess.Popen([sys.executable, __file__, "--floor-server", str(self.port), str(pause_s)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/ready")
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the floor server did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def measure(reps: int, rounds: int, warmup: int, flags: list[str]) -> dict:
    local = InProcess()
    server = Server(*flags)
    inproc: list[float] = []
    tokenizing: list[float] = []
    per_round = max(1, reps // rounds)
    pause = statistics.median(local.times(per_round, warmup, []))  # the floor's pause: one forward pass here
    floor = Floor(pause)
    # by client: the server's and the floor's query times, and their server-timing splits
    served: dict[str, tuple[list, list, list, list]] = {name: ([], [], [], []) for name in CLIENTS}
    conns = {name: (make(server.port), make(floor.port)) for name, make in CLIENTS.items()}
    try:
        for to_server, _ in conns.values():
            server_times(to_server, 0, warmup)  # the connections, the server's first batches
        for _ in range(rounds):
            inproc += local.times(per_round, warmup, tokenizing)
            for name, (to_server, to_floor) in conns.items():
                times, own, floor_times, floor_own = served[name]
                times += server_times(to_server, per_round, warmup, own)
                floor_times += server_times(to_floor, per_round, warmup, floor_own, check=False)
    finally:
        for pair in conns.values():
            for conn in pair:
                conn.close()
        floor.stop()
        server.stop()
        local.close()
    in_p50 = statistics.median(inproc) * 1000
    tok_p50 = statistics.median(tokenizing) * 1000
    by_client = {}
    for name, (times, own, floor_times, floor_own) in served.items():
        srv_p50 = statistics.median(times) * 1000
        # Everything but the model, all in the server's process: each query's client time less the forward
        # pass the server timed for it, less the tokenization the in-process query also does. Free of the
        # forward pass's difference between two processes, which on this machine moves by a millisecond
        # or more from one process start to the next (compare inprocess_embed_p50_ms, server_inference_p50_ms).
        beside_model = statistics.median(c - o["inference"] for c, o in zip(times, own, strict=True)) * 1000
        floor_ms = statistics.median(c - o["inference"] for c, o in zip(floor_times, floor_own, strict=True)) * 1000
        by_client[name] = {
            "server_p50_ms": round(srv_p50, 3), "server_p99_ms": percentile(times, 99),
            "overhead_ms": round(srv_p50 - in_p50, 3), "ratio": round(srv_p50 / in_p50, 3),
            "overhead_same_process_ms": round(beside_model - tok_p50, 3), "floor_ms": round(floor_ms, 3),
            "server_beyond_floor_ms": round(beside_model - tok_p50 - floor_ms, 3),
            "server_inference_p50_ms": round(statistics.median(o["inference"] for o in own) * 1000, 3),
            "server_tokenize_p50_ms": round(statistics.median(o["tokenize"] for o in own) * 1000, 3),
            "server_timing_p50_ms": round(statistics.median(o["total"] for o in own) * 1000, 3)}
    tokens = len(local.tokenizer.tokenizer.encode(QUERY).ids)
    return {"figure": "fastpath", "model": local.spec.name, "query_tokens": tokens, "reps": reps,
            "rounds": rounds, "server_flags": flags,
            "inprocess_p50_ms": round(in_p50, 3), "inprocess_p99_ms": percentile(inproc, 99),
            "inprocess_tokenize_p50_ms": round(tok_p50, 3),
            "inprocess_embed_p50_ms": round(statistics.median(a - t for a, t in zip(inproc, tokenizing, strict=True))
                                            * 1000, 3),
            "floor_pause_ms": round(pause * 1000, 3), **by_client, "cpu": cpu_name()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=300, help="timed queries per side, over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="alternate in-process and server this many times")
    p.add_argument("--warmup", type=int, default=20, help="untimed queries at the start of each round")
    p.add_argument("--server-flag", action="append", default=[], help="extra flag for `embedfleet serve`")
    p.add_argument("--floor-server", nargs=2, metavar=("PORT", "PAUSE_S"), help=argparse.SUPPRESS)
    add_results_dir(p, "fastpath-cpu.jsonl")
    a = p.parse_args()
    if a.floor_server:
        floor_server(int(a.floor_server[0]), float(a.floor_server[1]))
        return
    row = measure(a.reps, a.rounds, a.warmup, a.server_flag)
    print(json.dumps(row))
    record("fastpath", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
