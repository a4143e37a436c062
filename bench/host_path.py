"""The server's host path at large batches: embeddings per second of the whole server (HTTP, parsing,
tokenization, the batch manager, the response) with a null engine, this tree against a baseline checkout,
measured in the same run. One JSON line, also appended to bench/results/host-path-cpu.jsonl.

Why a null engine: the engine's own time is the same in both trees; what differs is the Python around it,
which on a GPU (batches of hundreds to a thousand inputs, a forward pass of milliseconds) is what keeps
the GPU waiting or not. The engine returns ones of the model's width (all-MiniLM-L6-v2, 384): the engine
thread, the model load and everything else run as in `embedfleet serve`.

Setup: each server runs `embedfleet serve --max-batch-requests 1024 --max-batch-tokens 65536` pinned to
CPU 0, with TorchEngine.embed replaced by the null engine; the load runs in this process on CPU 1: 32
concurrent clients (httpx), 64 texts of bench/_common.corpus() per request, encoding_format base64. Both
servers stay up; rounds alternate between them (baseline, this tree, baseline, ...), each after a warm-up
round, so that the machine's load (shared) falls on both alike. With --restarts N the pair of servers is
started N times in turn and all their rounds pooled: on a shared host one process can run slower than another
of the same code for its whole life (by up to a quarter here), which alternating rounds cannot even out.

Baseline: the code of a git checkout, e.g. `git worktree add /tmp/hostpath-base <commit>` (the tree this
work started from), passed as --baseline-tree.

Scenarios:
  null_engine                 the engine answers at once: the host path alone (HTTP, tokenizer, batch manager,
                              response), batches as small as the planner likes (about 7 inputs here)
  slow_engine                 the engine sleeps 3 us per padded token (--per-token-us), releasing the GIL as a
                              GPU's forward pass does: slower than the tokenizer, so the queue fills (the 32
                              clients' 2,048 inputs) and each plan runs over it while the engine waits

Figures, per scenario:
  embeddings_per_s            per side: the median of --rounds rounds of --texts texts (wall clock), and
                              every round's figure; ``speedup`` is this tree's median over the baseline's
  server_cpu_ms_per_1k        per side: the server process' CPU time (all its threads: the event loop, the
                              tokenizer's, the engine thread) per 1,000 embeddings, the median round; less
                              sensitive than throughput to what else runs on the machine
  loop_cpu_ms_per_1k          the same for the event loop's thread alone: the part this work changes
  base64_library              which base64 encoder the responses used (pybase64 if installed, else stdlib)
  by_kind                     the server's CPU per 1,000 embeddings by kind of thread, from the threads' OS
                              names (bench/_common.py thread_cpu_by_kind): loop, engine, tokenizer (the pool
                              and HF tokenizers' workers, which inherit its name), library, other
  rest_in_server_cpu_ms_per_1k  the server's CPU less its tokenizer and library threads', the median round:
                              the host path without the tokenizer, counted in the server itself. The
                              launcher names both trees' engine and tokenizer threads the same way
                              (_common.NAME_THREADS), so a baseline older than the runtime's own thread
                              names has its engine thread counted in its rest too
  rest_in_server_ratio        this tree's rest over the baseline's

--packed: the null engine declares packed sequences, as CUDA's BERT-family engines do (the planner packs the
oldest inputs into one batch; a tree older than packed planning ignores it), and the slow engine sleeps per
real token.

Run: .venv/bin/python bench/host_path.py --baseline-tree /tmp/hostpath-base (about a minute).

This machine (2 cores, a VM shared with other jobs; Python 3.11, pybase64 installed), the run in
bench/results/host-path-cpu.jsonl, baseline d517066 (the tree before this work), this tree 9d40402:
  null engine: 5,304 -> 5,730 embeddings/s (1.08x); the event loop's CPU 40.9 -> 32.3 ms per 1,000
    embeddings. The loop is not what limits this server: of its 169 ms of CPU per 1,000 embeddings,
    about 130 are the tokenizer's (HF tokenizers' encode_batch on this corpus, ~130 us a text measured
    alone), so the loop's work is under a fifth of the whole.
  slow engine: 3,149 -> 3,895 embeddings/s (1.24x); the loop's CPU 113.5 -> 62.9 ms per 1,000: with a full
    queue each plan walked every queued input (expiry, promotion, lateness, an Entry per input), while
    the engine waited for the next batch.
  Without pybase64 the base64 of a 64 x 384 response is about 160 us (4 us with it): 2.5 ms more of the
    loop's CPU per 1,000 embeddings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from _common import (
    NAME_THREADS,
    ROOT,
    add_results_dir,
    baseline_checkout,
    commit_of,
    corpus,
    free_port,
    pinned_to,
    record,
    stop_process,
    thread_cpu_by_kind,
    wait_ready,
)

LAUNCHER = NAME_THREADS + """
import sys, time
import numpy as np
tree, per_token_s, packed = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "packed"
sys.path[:0] = [f"{tree}/{part}" for part in ("runtime", "operator", "client", "gateway")]
from embedfleet.runtime.engines import torch_engine
def embed(self, batch):
    if per_token_s:  # a sleep releases the GIL, as a GPU's forward pass does
        time.sleep(per_token_s * (sum(map(len, batch)) if packed else max(map(len, batch)) * len(batch)))
    return np.ones((len(batch), 384), np.float32)
torch_engine.TorchEngine.embed = embed
if packed:  # as CUDA's BERT-family engines declare (a tree older than packed planning ignores it)
    torch_engine.TorchEngine.runs_packed = property(lambda self: True)
from embedfleet.runtime.cli import main
sys.exit(main(sys.argv[4:]))
"""
FLAGS = ("--max-batch-requests", "1024", "--max-batch-tokens", "65536", "--log-level", "warning")


class NullServer:
    """`embedfleet serve` from `tree`, with the null engine, pinned to `cpus`."""

    def __init__(self, tree: Path, cpus: set[int], per_token_s: float = 0.0, packed: bool = False) -> None:
        self.port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(tree), str(per_token_s), "packed" if packed else "padded",
             "serve", "--host", "127.0.0.1",
             "--port", str(self.port), *FLAGS],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned_to(cpus))
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_ready(self.url, self.proc)
        except BaseException:
            self.stop()
            raise

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far by kind of thread (bench/_common.py thread_cpu_by_kind): loop, engine, tokenizer,
        library, other."""
        return thread_cpu_by_kind(self.proc.pid)

    def stop(self) -> None:
        stop_process(self.proc)


async def load(url: str, texts: list[str], per_request: int, concurrency: int) -> float:
    """Seconds to embed `texts`, `per_request` a request, `concurrency` requests in flight."""
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                chunk = queue.get_nowait()
                r = await client.post("/v1/embeddings", json={"input": chunk, "encoding_format": "base64"})
                r.raise_for_status()
                assert len(r.json()["data"]) == len(chunk)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def measure(server: NullServer, texts: list[str], per_request: int, concurrency: int) -> dict:
    before = server.cpu()
    seconds = asyncio.run(load(server.url, texts, per_request, concurrency))
    after = server.cpu()
    per_1k = 1000 / len(texts) * 1000
    by_kind = {kind: (after[kind] - before.get(kind, 0.0)) * per_1k for kind in after}
    total = sum(by_kind.values())
    return {"embeddings_per_s": len(texts) / seconds, "server_cpu_ms_per_1k": total,
            "loop_cpu_ms_per_1k": by_kind.get("loop", 0.0), "by_kind": by_kind,
            "rest_in_server_cpu_ms_per_1k": total - by_kind.get("tokenizer", 0.0) - by_kind.get("library", 0.0)}


def summary(rounds: list[dict]) -> dict:
    rates = [r["embeddings_per_s"] for r in rounds]
    middle = sorted(rounds, key=lambda r: r["embeddings_per_s"])[len(rounds) // 2]
    return {"embeddings_per_s": round(statistics.median(rates), 1), "rounds": [round(x, 1) for x in rates],
            "server_cpu_ms_per_1k": round(middle["server_cpu_ms_per_1k"], 1),
            "loop_cpu_ms_per_1k": round(middle["loop_cpu_ms_per_1k"], 1),
            "by_kind": {kind: round(v, 1) for kind, v in middle["by_kind"].items()},
            "rest_in_server_cpu_ms_per_1k": round(
                statistics.median(r["rest_in_server_cpu_ms_per_1k"] for r in rounds), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-tree", type=Path, required=True, help="a checkout of the baseline commit")
    ap.add_argument("--texts", type=int, default=16384, help="texts per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per side, per pair of servers")
    ap.add_argument("--restarts", type=int, default=1,
                    help="pairs of servers started one after the other per scenario, their rounds pooled")
    ap.add_argument("--per-token-us", type=float, default=3.0,
                    help="the slow engine's time per padded token (microseconds)")
    ap.add_argument("--per-request", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--packed", action="store_true",
                    help="the null engine declares packed sequences, as CUDA's BERT-family engines do")
    add_results_dir(ap, "host-path-cpu.jsonl")
    args = ap.parse_args()
    baseline_checkout(args.baseline_tree)
    os.sched_setaffinity(0, {1})  # the load on CPU 1, the servers on CPU 0
    texts = corpus(args.texts)
    sides = {"baseline": args.baseline_tree, "this_tree": ROOT}
    scenarios = {"null_engine": 0.0, "slow_engine": args.per_token_us * 1e-6}
    figures = {}
    for scenario, per_token_s in scenarios.items():
        rounds: dict[str, list[dict]] = {name: [] for name in sides}
        for _ in range(args.restarts):  # a process' own luck (its placement on a shared host) falls on both sides
            servers = {name: NullServer(tree, {0}, per_token_s, args.packed) for name, tree in sides.items()}
            try:
                for server in servers.values():  # warm-up: connections, allocator, first batches
                    measure(server, texts[:4096], args.per_request, args.concurrency)
                for _ in range(args.rounds):
                    for name, server in servers.items():
                        rounds[name].append(measure(server, texts, args.per_request, args.concurrency))
            finally:
                for server in servers.values():
                    server.stop()
        base, new = summary(rounds["baseline"]), summary(rounds["this_tree"])
        figures[scenario] = {"baseline": base, "this_tree": new,
                             "speedup": round(new["embeddings_per_s"] / base["embeddings_per_s"], 3),
                             "rest_in_server_ratio": round(new["rest_in_server_cpu_ms_per_1k"]
                                                           / base["rest_in_server_cpu_ms_per_1k"], 3)}
    try:
        import pybase64  # noqa: F401
        library = "pybase64"
    except ImportError:
        library = "stdlib"
    result = {"bench": "host_path", "baseline_commit": commit_of(args.baseline_tree),
              "this_tree_commit": commit_of(ROOT) + ("+dirty" if subprocess.run(
                  ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "runtime"]).returncode else ""),
              **figures, "packed": args.packed,
              "slow_engine_us_per_padded_token": args.per_token_us, "texts_per_round": args.texts,
              "rounds": args.rounds, "restarts": args.restarts, "per_request": args.per_request,
              "concurrency": args.concurrency, "encoding_format": "base64", "base64_library": library,
              "python": platform.python_version(), "machine": f"{platform.machine()}, shared 2-core VM"}
    line = json.dumps(result)
    print(line)
    record("host-path", result, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
