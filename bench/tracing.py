"""What OpenTelemetry tracing costs one short query at concurrency 1 (docs/tracing.md).

Two `embedfleet serve` processes on the default model, started alike with the same OTEL_* variables
(an OTLP/HTTP endpoint: a local sink that accepts and drops every export): one with tracing off (the
default), one with `--otel` (every request sampled). A keep-alive connection per round from http.client,
POST /v1/embeddings {"input": <one short query>} one at a time, the two measured in interleaved rounds in
one run, so that a neighbour's load shifts both alike. Also times the hooks as they run with tracing
off (the checks the gate, the tokenizer, the queue and the answer make per request), in this process.

Prints one JSON line, also appended to bench/results/tracing-cpu.jsonl: p50/p99 off and on (ms), the ratio
on/off of the p50s, and the off hooks' time per request in microseconds and as a fraction of the off p50.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading
import time
import timeit
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from _common import Server, add_results_dir, record
from fastpath import QUERY, percentile, server_times


class Sink(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def off_hooks_us(n: int = 200_000) -> float:
    """Microseconds per request of the tracing checks made with tracing off: the gate's `is None`, three
    `current_trace()` reads (tokenize, queue, encode) each with its `is None`, the batcher's two checks."""
    from embedfleet.runtime.api.gate import GateState
    from embedfleet.runtime.tracing import current_trace

    state = GateState()
    job_trace = None

    def hooks() -> None:
        _ = state.tracing is None
        for _i in range(3):
            _ = current_trace() is None
        _ = job_trace is not None
        _ = job_trace is not None

    return timeit.timeit(hooks, number=n) / n * 1e6


def measure(reps: int, rounds: int, warmup: int) -> dict:
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.server_address[1]}",
                       "OTEL_TRACES_SAMPLER": "always_on"})
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "EMBEDFLEET_OTEL"):
        os.environ.pop(name, None)
    off, on = Server(), Server("--otel")
    ports = {"off": off.port, "on": on.port}
    samples: dict[str, list[float]] = {"off": [], "on": []}
    try:
        per_round = max(1, reps // rounds)
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for name in order:  # a connection per round: the other side's round outlasts keep-alive
                conn = http.client.HTTPConnection("127.0.0.1", ports[name], timeout=60)
                try:
                    samples[name] += server_times(conn, per_round, warmup)
                finally:
                    conn.close()
    finally:
        off.stop()
        on.stop()
        sink.shutdown()
    hooks = off_hooks_us()
    p50_off, p50_on = percentile(samples["off"], 50), percentile(samples["on"], 50)
    return {"bench": "tracing", "query_chars": len(QUERY), "reps_per_side": len(samples["off"]),
            "p50_off_ms": p50_off, "p99_off_ms": percentile(samples["off"], 99),
            "p50_on_ms": p50_on, "p99_on_ms": percentile(samples["on"], 99),
            "ratio_on_off_p50": round(p50_on / p50_off, 3), "off_hooks_us": round(hooks, 3),
            "off_hooks_fraction_of_p50": round(hooks / 1000 / p50_off, 6), "unix_time": int(time.time())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=300, help="timed queries per side, over all rounds")
    p.add_argument("--rounds", type=int, default=4, help="alternate off and on this many times")
    p.add_argument("--warmup", type=int, default=20, help="untimed queries per side at the start of each round")
    add_results_dir(p, "tracing-cpu.jsonl")
    a = p.parse_args()
    row = measure(a.reps, a.rounds, a.warmup)
    print(json.dumps(row))
    record("tracing", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
