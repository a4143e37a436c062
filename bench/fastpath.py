"""The single-query fast path: what the server adds to one short query at concurrency 1.

In-process: the TorchEngine on the default model (threads as `embedfleet serve` sets them), driven
from one dedicated thread as the server's engine thread is; one query is tokenize + embed. Server:
`embedfleet serve` in its own process, one keep-alive connection from the standard library's
http.client (the leanest Python client: httpx alone adds about 0.8 ms per request on this machine,
which is the client's cost, not the server's), POST /v1/embeddings {"input": <the same query>} one at
a time. Both are measured in interleaved rounds in one run, so that a neighbour's load on a small
machine shifts both alike; each sample is one query's wall time.

Prints one JSON line: in-process p50, server p50 and p99 as the client saw them, their difference (the
overhead of HTTP, validation, thread hops and encoding) and ratio, the server's own time for the
request (`server-timing`, gate to answer) and the CPU.

The difference between two processes also holds the difference between their forward passes, which
on a small VM moves by a millisecond or more from one process start to the next: the same model,
the same thread count, another placement of its weights and threads. So the server's own split of
each query (server-timing: tokenize, queue, inference) gives a second figure, `overhead_same_process_ms`:
each query's client time less the forward pass the server timed for it, less the in-process
tokenization, as a median; the model's time then comes from the process that served the query.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from _common import Server
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


def server_times(conn: http.client.HTTPConnection, n: int, warmup: int,
                 own: list[dict[str, float]] | None = None) -> list[float]:
    """Whole queries' times as the client saw them; the server's split of each (server-timing, in
    seconds by part) is appended to `own`."""
    body = json.dumps({"input": QUERY}).encode()
    headers = {"content-type": "application/json"}
    out = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/embeddings", body, headers)
        r = conn.getresponse()
        data = r.read()
        elapsed = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data[:200]!r}")
        if i >= warmup:
            out.append(elapsed)
            if own is not None:
                own.append(server_timing(r.getheader("server-timing")))
    assert len(json.loads(data)["data"][0]["embedding"]) == 384
    return out


def measure(reps: int, rounds: int, warmup: int, flags: list[str]) -> dict:
    local = InProcess()
    server = Server(*flags)
    inproc: list[float] = []
    tokenizing: list[float] = []
    served: list[float] = []
    own: list[dict[str, float]] = []
    per_round = max(1, reps // rounds)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        server_times(conn, 0, warmup)  # the connection, the server's first batches
        for _ in range(rounds):
            inproc += local.times(per_round, warmup, tokenizing)
            served += server_times(conn, per_round, warmup, own)
    finally:
        conn.close()
        server.stop()
        local.close()
    in_p50, srv_p50 = statistics.median(inproc) * 1000, statistics.median(served) * 1000
    tok_p50 = statistics.median(tokenizing) * 1000
    # Everything but the model, all in the server's process: each query's client time less the forward
    # pass the server timed for it, less the tokenization the in-process query also does. Free of the
    # forward pass's difference between two processes, which on this machine moves by a millisecond
    # or more from one process start to the next (compare inprocess_embed_p50_ms, server_inference_p50_ms).
    beside_model = statistics.median(c - o["inference"] for c, o in zip(served, own, strict=True)) * 1000
    tokens = len(local.tokenizer.tokenizer.encode(QUERY).ids)
    return {"figure": "fastpath", "model": local.spec.name, "query_tokens": tokens, "reps": len(served),
            "rounds": rounds, "server_flags": flags,
            "inprocess_p50_ms": round(in_p50, 3), "inprocess_p99_ms": percentile(inproc, 99),
            "server_p50_ms": round(srv_p50, 3), "server_p99_ms": percentile(served, 99),
            "overhead_ms": round(srv_p50 - in_p50, 3), "ratio": round(srv_p50 / in_p50, 3),
            "overhead_same_process_ms": round(beside_model - tok_p50, 3),
            "inprocess_tokenize_p50_ms": round(tok_p50, 3),
            "inprocess_embed_p50_ms": round(statistics.median(a - t for a, t in zip(inproc, tokenizing, strict=True))
                                            * 1000, 3),
            "server_inference_p50_ms": round(statistics.median(o["inference"] for o in own) * 1000, 3),
            "server_tokenize_p50_ms": round(statistics.median(o["tokenize"] for o in own) * 1000, 3),
            "server_timing_p50_ms": round(statistics.median(o["total"] for o in own) * 1000, 3),
            "client": "http.client",
            "cpu": cpu_name()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=300, help="timed queries per side, over all rounds")
    p.add_argument("--rounds", type=int, default=3, help="alternate in-process and server this many times")
    p.add_argument("--warmup", type=int, default=20, help="untimed queries at the start of each round")
    p.add_argument("--server-flag", action="append", default=[], help="extra flag for `embedfleet serve`")
    a = p.parse_args()
    print(json.dumps(measure(a.reps, a.rounds, a.warmup, a.server_flag)))


if __name__ == "__main__":
    main()
