"""The hand-over between a front process (asyncio: HTTP, tokenizer) and an engine process: what it costs to
move token ids one way and vectors back, per transport, against the in-process hand-off of today's server.

Transports, each between this process (the front: one asyncio loop, as uvicorn's) and one engine process
running a null engine (vectors of zeros, dimension 384, one batch at a time, as a model would):

- ``unix``: one Unix stream socket, a fixed struct header and raw int32/float32 payloads; asyncio streams on
  the front, a blocking socket on the engine side.
- ``zmq``: pyzmq DEALER (zmq.asyncio) to ROUTER over ``ipc://``, the header as msgspec msgpack and the
  payloads as zero-copy frames (vLLM's API-server to engine-core design).
- ``inproc`` (the baseline): the same null engine on a thread of this process, handed work the way the
  server's batch manager does (a thread pool and an asyncio future), so the rows show what a process
  boundary adds.

Workloads: ``query`` (1 input of 16 tokens, one client: round-trip latency) and ``bulk`` (32 inputs of 64
tokens, 8 clients in a closed loop: embeddings/s). CPU is read per process from /proc (front and engine
separately) and reported per 1,000 embeddings. One row per run goes to bench/results/ipc-cpu.jsonl.

    python bench/ipc.py                    # all transports, both workloads
    python bench/ipc.py --seconds 2        # a quick trial (with --results-dir /tmp/x)

pyzmq and msgspec are needed by this bench only (the peer it measures, not dependencies of embedfleet):
``.venv/bin/uv pip install --python .venv/bin/python pyzmq msgspec``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from _common import add_results_dir, record, thread_cpu_seconds
from embedfleet.runtime.core import wire

DIM = 384
LIMITS = wire.Limits()
WARM = 200  # requests sent before the measured window
WORKLOADS = {"query": (1, 16, 1), "bulk": (32, 64, 8)}  # inputs, tokens per input, clients


def null_engine(rows: list) -> np.ndarray:
    """A model's side of a batch without the model: the rows padded into one id matrix (as every engine
    does before its forward pass), and n x DIM float32 zeros for the vectors."""
    padded = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)
    for i, row in enumerate(rows):
        padded[i, :len(row)] = row
    return np.zeros((len(rows), DIM), dtype=np.float32)


# -- engine processes ----------------------------------------------------------------------------------------
def serve_unix(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        srv.listen(1)
        conn, _ = srv.accept()
        with conn:
            head = bytearray(wire.REQUEST.size)
            while True:
                if not recv_into(conn, memoryview(head)):
                    return
                req_id, inputs, tokens, size = wire.request_body_size(head, LIMITS)
                body = bytearray(size)
                if not recv_into(conn, memoryview(body)):
                    return
                vectors = null_engine(wire.decode_request_body(body, inputs, tokens))
                conn.sendmsg(wire.encode_reply(req_id, vectors))


def recv_into(conn: socket.socket, view: memoryview) -> bool:
    while view:
        got = conn.recv_into(view)
        if not got:
            return False
        view = view[got:]
    return True


def serve_zmq(path: str) -> None:
    import msgspec
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{path}")
    decode, encode = msgspec.msgpack.Decoder(dict).decode, msgspec.msgpack.Encoder().encode
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            return
        identity, head, offsets_frame, ids_frame = frames
        meta = decode(head.buffer)
        offsets = np.frombuffer(offsets_frame.buffer, dtype=np.int32)
        ids = np.frombuffer(ids_frame.buffer, dtype=np.int32)
        vectors = null_engine(wire.split_rows(ids, offsets))  # lists, as the Unix socket's reader hands over
        sock.send_multipart([identity, encode({"id": meta["id"], "n": meta["n"], "dim": DIM, "status": 0}),
                             vectors.tobytes()], copy=False)


# -- fronts --------------------------------------------------------------------------------------------------
class UnixFront:
    def __init__(self, path: str) -> None:
        self.path = path
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0

    async def start(self) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(self.path)
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            try:
                head = await self.reader.readexactly(wire.REPLY.size)
            except asyncio.IncompleteReadError:
                return
            req_id, rows, dim, status, size = wire.reply_body_size(head, LIMITS)
            body = await self.reader.readexactly(size)
            self.pending.pop(req_id).set_result(wire.decode_reply_body(body, rows, dim, status))

    async def embed(self, batch: list[list[int]]) -> np.ndarray:
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        self.writer.writelines(wire.encode_request(self.next_id, batch))
        return await future

    async def close(self) -> None:
        self.writer.close()
        self.task.cancel()


class ZmqFront:
    def __init__(self, path: str) -> None:
        import msgspec
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"ipc://{path}")
        self.encode, self.decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(dict).decode
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0

    async def start(self) -> None:
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            head, body = await self.sock.recv_multipart(copy=False)
            meta = self.decode(head.buffer)
            vectors = np.frombuffer(body.buffer, dtype=np.float32).reshape(meta["n"], meta["dim"])
            self.pending.pop(meta["id"]).set_result(vectors)

    async def embed(self, batch: list[list[int]]) -> np.ndarray:
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        _head, offsets, ids = wire.encode_request(self.next_id, batch)  # the same buffers as the unix front's
        await self.sock.send_multipart([self.encode({"id": self.next_id, "n": len(batch)}), offsets, ids],
                                       copy=False)
        return await future

    async def close(self) -> None:
        await self.sock.send_multipart([b"stop"])
        self.task.cancel()
        self.sock.close(linger=1000)
        self.ctx.term()


class InprocFront:
    """Today's hand-off: the engine on a worker thread, its answer set on an asyncio future."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)

    async def start(self) -> None:
        pass

    async def embed(self, batch: list[list[int]]) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self.pool, null_engine, batch)

    async def close(self) -> None:
        self.pool.shutdown()


# -- a run ---------------------------------------------------------------------------------------------------
def process_cpu(pid: int) -> float:
    return sum(thread_cpu_seconds(pid))


async def drive(front, workload: str, seconds: float) -> dict:
    inputs, tokens, clients = WORKLOADS[workload]
    batch = [[101 + (i * 7 + k) % 20000 for k in range(tokens)] for i in range(inputs)]
    latencies: list[float] = []
    until = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < until:
            started = time.perf_counter()
            vectors = await front.embed(batch)
            latencies.append(time.perf_counter() - started)
            assert vectors.shape == (inputs, DIM)

    for _ in range(WARM):  # warm the path (and the engine's allocator) before measuring
        await front.embed(batch)
    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.monotonic() - started
    latencies.sort()
    return {"requests": len(latencies), "seconds": round(elapsed, 3),
            "embeddings_per_s": round(len(latencies) * inputs / elapsed, 1),
            "p50_us": round(1e6 * latencies[len(latencies) // 2], 1),
            "p99_us": round(1e6 * latencies[int(0.99 * (len(latencies) - 1))], 1)}


def measure(transport: str, workload: str, seconds: float) -> dict:
    folder = tempfile.mkdtemp(prefix="embedfleet-ipc-")
    path = os.path.join(folder, "engine.sock")
    engine = None
    if transport != "inproc":
        engine = subprocess.Popen([sys.executable, __file__, "--engine", transport, "--path", path])
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            if engine.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {transport} engine did not start")
            time.sleep(0.01)

    async def main() -> dict:
        front = {"unix": UnixFront, "zmq": ZmqFront}[transport](path) if engine else InprocFront()
        await front.start()
        inputs = WORKLOADS[workload][0]
        front_cpu = sum(os.times()[:2])
        engine_cpu = process_cpu(engine.pid) if engine else 0.0
        out = await drive(front, workload, seconds)
        front_cpu = sum(os.times()[:2]) - front_cpu  # in-process: the engine thread's CPU is in here too
        engine_cpu = process_cpu(engine.pid) - engine_cpu if engine else 0.0
        per_k = 1000 / ((out["requests"] + WARM) * inputs)  # the CPU window holds the warm-up's requests too
        out.update(front_cpu_ms_per_1k=round(1000 * front_cpu * per_k, 2),
                   engine_cpu_ms_per_1k=round(1000 * engine_cpu * per_k, 2),
                   total_cpu_ms_per_1k=round(1000 * (front_cpu + engine_cpu) * per_k, 2))
        await front.close()
        return out

    try:
        return asyncio.run(main())
    finally:
        if engine is not None:
            try:
                engine.wait(10)
            except subprocess.TimeoutExpired:
                engine.kill()
                engine.wait()
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per transport and workload")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (transports alternate within a round)")
    parser.add_argument("--engine", choices=["unix", "zmq"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    add_results_dir(parser, "ipc-cpu.jsonl")
    args = parser.parse_args()
    if args.engine:
        (serve_unix if args.engine == "unix" else serve_zmq)(args.path)
        return
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        sys.exit("ipc: pyzmq and msgspec are not installed. They are needed by this bench only (not dependencies "
                 "of embedfleet): .venv/bin/uv pip install --python .venv/bin/python pyzmq msgspec")
    transports = ["inproc", "unix", "zmq"]
    samples: dict[str, dict[str, list[dict]]] = {t: {w: [] for w in WORKLOADS} for t in transports}
    for _ in range(args.rounds):
        for workload in WORKLOADS:
            for transport in transports:
                samples[transport][workload].append(measure(transport, workload, args.seconds))
    row: dict = {"bench": "ipc", "rounds": args.rounds, "seconds": args.seconds, "dim": DIM,
                 "workloads": {w: {"inputs": i, "tokens": t, "clients": c} for w, (i, t, c) in WORKLOADS.items()}}
    for transport in transports:
        row[transport] = {}
        for workload in WORKLOADS:
            runs = samples[transport][workload]
            row[transport][workload] = {key: round(statistics.median(r[key] for r in runs), 2) for key in
                                        ("embeddings_per_s", "p50_us", "p99_us", "front_cpu_ms_per_1k",
                                         "engine_cpu_ms_per_1k", "total_cpu_ms_per_1k")}
    for transport in ("unix", "zmq"):
        for workload in WORKLOADS:
            ours, base = row[transport][workload], row["inproc"][workload]
            ours["rate_over_inproc"] = round(ours["embeddings_per_s"] / base["embeddings_per_s"], 3)
    print(record("ipc", row, results_dir=args.results_dir))
    print(row)


if __name__ == "__main__":
    main()
