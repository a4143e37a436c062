"""Where one query's time goes: a single short query at concurrency 1, stage by stage, against the in-process
ceiling's single query in the same run.

`embedfleet serve` runs with timestamps taken at the stage boundaries of the request path (the launcher
below wraps those functions; nothing else changes), one blocking client sends short queries one at a time,
and each request's boundaries are read back in order. The row holds each stage's median in microseconds,
the client's p50, the ceiling's single query p50 (bench/ceiling.py, its own process, alternating with the
server in rounds) and the engine's forward pass as the server ran it, so the row shows which stages the
overhead over the ceiling is made of. Each stage includes the cost of its timestamps (about a microsecond
each); the headline single-query figure is bench/runtime_report.py's, which has no instrumentation.

Prints one JSON line, also appended to bench/results/c1_stages-cpu.jsonl.
"""

from __future__ import annotations

import argparse
import bisect
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import SOURCE_PATHS, add_results_dir, free_port, record, stop_process, wait_ready
from ceiling import SINGLE_QUERY, CeilingProcess

LAUNCHER = r"""
import atexit, functools, inspect, json, sys, time
EVENTS = []
now = time.perf_counter_ns

def wrap(cls, attr, before, after=None):
    fn = getattr(cls, attr)
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed(*a, **k):
            EVENTS.append((before, now()))
            try:
                return await fn(*a, **k)
            finally:
                if after:
                    EVENTS.append((after, now()))
    else:
        @functools.wraps(fn)
        def timed(*a, **k):
            EVENTS.append((before, now()))
            try:
                return fn(*a, **k)
            finally:
                if after:
                    EVENTS.append((after, now()))
    setattr(cls, attr, timed)

from embedfleet import httpserver
from embedfleet.runtime import service
from embedfleet.runtime.api import gate
from embedfleet.runtime.core import batcher
from embedfleet.runtime.engines import torch_engine
wrap(httpserver.BoundedProtocol, "data_received", "recv")
wrap(gate.Gate, "__call__", "gate")
wrap(service.ModelService, "tokenize", "tok0", "tok1")
wrap(batcher.BatchManager, "_kick", "kick")
wrap(batcher.BatchManager, "_compute", "engine")
wrap(torch_engine.TorchEngine, "embed", "fwd0", "fwd1")
wrap(batcher.BatchManager, "_finish", "finish")
wrap(service.ModelService, "run", "run0", "run1")
wrap(httpserver._Ending, "write", "write")
atexit.register(lambda: open(sys.argv[1], "w").write(json.dumps(EVENTS)))
from embedfleet.runtime.cli import main
sys.exit(main(sys.argv[2:]))
"""

# (stage, from boundary, to boundary): the first event of each name within a request, except the last write
STAGES = (
    ("client_to_server", "client_send", "recv"),  # the client's request out, the kernel, the loop woken
    ("http_to_gate", "recv", "gate"),  # HTTP parsing, uvicorn's cycle, FastAPI's outer middleware
    ("gate_to_tokenize", "gate", "tok0"),  # admission, dispatch, body read, JSON and validation
    ("tokenize", "tok0", "tok1"),
    ("to_batch_manager", "tok1", "kick"),  # submit, and the loop turn to the plan
    ("hand_to_engine", "kick", "engine"),  # plan, post, the engine thread woken
    ("before_forward", "engine", "fwd0"),
    ("forward", "fwd0", "fwd1"),  # TorchEngine.embed: padding, the model, pooling, to numpy
    ("back_to_loop", "fwd1", "finish"),  # the engine thread's hand-back, the loop woken
    ("to_handler", "finish", "run1"),  # the futures set, the handler resumed
    ("response", "run1", "write"),  # post-processing, JSON, the response through the ASGI layers
    ("writes", "write", "last_write"),
    ("server_to_client", "last_write", "client_done"),  # the kernel, the client woken, its parsing
)


def stages(events: list[tuple[str, int]], windows: list[tuple[int, int]]) -> dict[str, list[float]]:
    """Each stage's microseconds per request, from the events inside each client window."""
    events = sorted(events, key=lambda e: e[1])  # the server's threads append out of order: bisect needs order
    times = [t for _, t in events]
    out: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for sent, done in windows:
        inside = events[bisect.bisect_left(times, sent):bisect.bisect_right(times, done)]
        first: dict[str, int] = {"client_send": sent, "client_done": done}
        for name, t in inside:
            first.setdefault(name, t)
        writes = [t for name, t in inside if name == "write"]
        if writes:
            first["last_write"] = writes[-1]
        for name, a, b in STAGES:
            if a in first and b in first:
                out[name].append((first[b] - first[a]) / 1000)
    return out


def serve_and_time(flags: list[str], requests: int, warm: int) -> tuple[list, list]:
    """The instrumented server's events and the client's (sent, done) windows, after `warm` requests."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "events.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS), HF_HUB_OFFLINE="1")
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(dump), "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning", *flags],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            windows = []
            for i in range(warm + requests):
                body = json.dumps({"model": "all-MiniLM-L6-v2", "input": f"{SINGLE_QUERY} {i}"}).encode()
                sent = time.perf_counter_ns()
                conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"the server answered {resp.status}")
                if i >= warm:
                    windows.append((sent, time.perf_counter_ns()))
            conn.close()
        finally:
            stop_process(proc)
        return json.loads(dump.read_text()), windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--warm", type=int, default=100)
    p.add_argument("--dtype", default="float32")
    add_results_dir(p, "c1_stages-cpu.jsonl")
    a = p.parse_args()
    with CeilingProcess(a.dtype) as ceiling:
        before = ceiling.single(a.requests // 2)
        events, windows = serve_and_time(["--dtype", a.dtype], a.requests, a.warm)
        after = ceiling.single(a.requests // 2)
    per_stage = stages(events, windows)
    client = statistics.median((done - sent) / 1000 for sent, done in windows)
    inproc = statistics.median(before + after) * 1e6
    medians = {name: round(statistics.median(v), 1) for name, v in per_stage.items() if v}
    row = {"figure": "c1_stages", "dtype": a.dtype, "requests": a.requests, "client": "http.client, one connection",
           "stages_us": medians, "client_p50_us": round(client, 1), "ceiling_single_query_us": round(inproc, 1),
           "overhead_us": round(client - inproc, 1),
           "outside_forward_us": round(client - medians.get("forward", 0.0), 1)}
    print(json.dumps(row))
    record("c1_stages", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
