"""Split serving (`embedfleet serve --fronts N`) against the single process, same run: embeddings per second
and the server's CPU per 1,000 embeddings summed over all its processes, by role.

The engine is the null engine of bench/host_path.py (ones of the model's width, at once; --per-token-us
makes it sleep per padded token, releasing the GIL as a GPU's forward pass does), so the figures are the
host path's: HTTP, parsing, tokenization, the hand-off to the engine and back, the response. With
`--model-engine` the real model runs instead.

Each configuration is one server: `--fronts 0` (the single process) and each N of --fronts. They stay up;
rounds alternate between them after a warm-up round each, so that the machine's load falls on all alike.
The servers are confined to --server-cpus and the load (this process: --concurrency httpx clients, --per-request
texts of bench/_common.corpus() per request, base64) to --load-cpus.

Figures, per configuration:
  embeddings_per_s        the median of --rounds rounds (wall clock), and every round's
  server_cpu_ms_per_1k    CPU time of every process of the server (supervisor, engine, fronts) per 1,000
                          embeddings, in the median round
  by_role                 the same by process role, each split into its main thread (the event loop) and
                          its other threads (tokenizer pool, HF tokenizers' own threads, the engine thread)
  ratio                   embeddings_per_s over the single process's in the same run
  rest_cpu_ms_per_1k      server_cpu_ms_per_1k less the tokenizer's: the tokenizer's CPU per 1,000 embeddings
                          (`tokenizer_cpu_ms_per_1k`) is measured in this process, on the same texts in the
                          same requests, with the server's tokenizer calls; what is left is the host path's
  by_kind                 the same by kind of thread over all the server's processes, from the threads' OS
                          names: loop, engine, tokenizer (the pool handing batches to HF tokenizers),
                          library (threads the runtime did not name: HF tokenizers' Rust workers here, as
                          the null engine computes nothing), other
  rest_in_server_cpu_ms_per_1k   server_cpu_ms_per_1k less the tokenizer and library threads' CPU, measured in
                          the server in the same round (the median of the rounds): the same split as
                          rest_cpu_ms_per_1k without comparing two processes' clocks on a shared machine
                          (null engine only: with the model, torch's own threads are library threads too)

With `--packed both`, every configuration also runs with the null engine declaring packed sequences (as the
CUDA engine does for BERT-family embedders: a batch costs its real tokens, so the planner packs the oldest
inputs instead of grouping them by length): `packed_fronts_N`, against the same padded single process. The
null engine then sleeps per real token, not per padded one.

With `--engines 1,2`, every split configuration also runs with each engine count above 1
(`fronts_N_engines_M`: `--engines M`, M engine processes with their share of the cores each), against the
same single process: on a CPU with `--model-engine`, whether M engines of fewer threads beat one of all the
cores; on a GPU, whether two engines keep it busier than one.

With `--baseline-tree DIR` (a checkout of another commit: `git worktree add DIR <commit>`), every
configuration also runs from that tree (`baseline_<name>`, in the rounds beside its twin), and each of this
tree's configurations gets `over_baseline`: its throughput, server CPU, rest and each role's event-loop CPU
over its twin's, same run.

Run: .venv/bin/python bench/split_serving.py --fronts 1,2 (about two minutes on two cores). On a machine
with cores to scale on (the GPU machine's 16): --fronts 1,4,8 --server-cpus 0-13 --load-cpus 14-15.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    run_meta,
    source_paths,
    stop_process,
    thread_cpu_by_kind,
    wait_ready,
)
from host_path import load

# Loaded by every process of the server (sitecustomize): the engine process (or the single process) gets the
# null engine; a front never imports torch, so it is left alone.
SITE = NAME_THREADS + """
import os, time
if os.environ.get("_EMBEDFLEET_SPLIT_ROLE") != "front" and os.environ.get("BENCH_NULL_ENGINE") == "1":
    import numpy as np
    from embedfleet.runtime.engines import torch_engine
    per_token_s = float(os.environ.get("BENCH_PER_TOKEN_S", "0"))
    def embed(self, batch):
        if per_token_s:
            time.sleep(per_token_s * max(map(len, batch)) * len(batch))
        return np.ones((len(batch), 384), np.float32)
    if os.environ.get("BENCH_PACKED") == "1":
        def embed(self, batch):
            if per_token_s:
                time.sleep(per_token_s * sum(map(len, batch)))
            return np.ones((len(batch), 384), np.float32)
        torch_engine.TorchEngine.runs_packed = property(lambda self: True)
    torch_engine.TorchEngine.embed = embed
"""
FLAGS = ("--max-batch-requests", "1024", "--max-batch-tokens", "65536", "--log-level", "warning")


def cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


class SplitServer:
    def __init__(self, fronts: int, cpus: set[int], site_dir: str, null_engine: bool, per_token_s: float,
                 packed: bool = False, tree: Path = ROOT, engines: int = 1) -> None:
        self.fronts = fronts
        self.port = free_port()
        env = dict(os.environ, HF_HUB_OFFLINE="1", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16",
                   PYTHONPATH=os.pathsep.join([site_dir, *source_paths(tree)]),
                   BENCH_NULL_ENGINE="1" if null_engine else "0", BENCH_PER_TOKEN_S=str(per_token_s),
                   BENCH_PACKED="1" if packed else "0")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--fronts", str(fronts), *(("--engines", str(engines)) if engines > 1 else ()), *FLAGS],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned_to(cpus))
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_ready(self.url, self.proc)
        except BaseException:
            self.stop()
            raise

    def roles(self) -> dict[int, str]:
        pids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        roles = {self.proc.pid: "supervisor" if self.fronts else "single"}
        for pid in map(int, pids):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            roles[pid] = "front" if b"_EMBEDFLEET_SPLIT_ROLE=front" in environ else "engine"
        return roles

    def cpu(self) -> dict[str, list[float]]:
        """role -> [main thread, other threads] CPU seconds, summed over the role's processes; and under
        "kind:<kind>" each kind of thread (bench/_common.py thread_cpu_by_kind) over all processes."""
        out: dict[str, list[float]] = {}
        for pid, role in self.roles().items():
            acc = out.setdefault(role, [0, 0])
            for kind, seconds in thread_cpu_by_kind(pid).items():
                acc[0 if kind == "loop" else 1] += seconds
                out.setdefault(f"kind:{kind}", [0, 0])[0] += seconds
        return out

    def stop(self) -> None:
        stop_process(self.proc)


def measure(server: SplitServer, texts: list[str], per_request: int, concurrency: int) -> dict:
    before = server.cpu()
    seconds = asyncio.run(load(server.url, texts, per_request, concurrency))
    after = server.cpu()
    per_1k = 1000 / len(texts) * 1000  # ms per 1,000 embeddings
    by_role = {role: {"loop": round((after[role][0] - before.get(role, [0, 0])[0]) * per_1k, 1),
                      "threads": round((after[role][1] - before.get(role, [0, 0])[1]) * per_1k, 1)}
               for role in after if not role.startswith("kind:")}
    by_kind = {role[5:]: round((after[role][0] - before.get(role, [0, 0])[0]) * per_1k, 1)
               for role in after if role.startswith("kind:")}
    total = sum(v["loop"] + v["threads"] for v in by_role.values())
    # the tokenizer's CPU counted in the server itself: its pool's threads and HF tokenizers' workers
    tokenizer = by_kind.get("tokenizer", 0.0) + by_kind.get("library", 0.0)
    return {"embeddings_per_s": len(texts) / seconds, "server_cpu_ms_per_1k": round(total, 1), "by_role": by_role,
            "by_kind": by_kind, "rest_in_server_cpu_ms_per_1k": round(total - tokenizer, 1)}


def summary(rounds: list[dict]) -> dict:
    middle = sorted(rounds, key=lambda r: r["embeddings_per_s"])[len(rounds) // 2]
    return {"embeddings_per_s": round(statistics.median(r["embeddings_per_s"] for r in rounds), 1),
            "rounds": [round(r["embeddings_per_s"], 1) for r in rounds],
            "server_cpu_ms_per_1k": middle["server_cpu_ms_per_1k"], "by_role": middle["by_role"],
            "by_kind": middle["by_kind"],
            "rest_in_server_cpu_ms_per_1k": round(statistics.median(r["rest_in_server_cpu_ms_per_1k"] for r in rounds),
                                                  1)}


def over(figure: dict, base: dict) -> dict:
    """This tree's figures over the baseline tree's, same configuration and run: throughput, server CPU,
    the rest (less the tokenizer), and each role's event loop."""
    out = {"embeddings_per_s": round(figure["embeddings_per_s"] / base["embeddings_per_s"], 3)}
    for key in ("server_cpu_ms_per_1k", "rest_cpu_ms_per_1k", "rest_in_server_cpu_ms_per_1k"):
        out[key] = round(figure[key] / base[key], 3) if base[key] > 0 else None
    for role, cpu in figure["by_role"].items():
        was = base["by_role"].get(role, {}).get("loop", 0.0)
        if was > 0:
            out[f"{role}_loop"] = round(cpu["loop"] / was, 3)
    return out


def tokenizer_cpu_ms_per_1k(texts: list[str], per_request: int, rounds: int = 3) -> float:
    """The tokenizer's CPU per 1,000 embeddings on `texts` cut into the bench's requests, called as the server
    calls it (core/tokenize.py: the default model's tokenizer, the pool's encode path), the best of `rounds`.
    All of this process' threads count (HF tokenizers parallelises a batch on its own threads)."""
    from embedfleet.runtime.core.tokenize import TokenizerPool
    from embedfleet.runtime.settings import default_model_dir

    pool = TokenizerPool(default_model_dir() / "tokenizer.json", 1)
    try:
        chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
        best = float("inf")
        for _ in range(rounds):
            started = time.process_time()
            for chunk in chunks:
                pool._encode_sync(chunk, 512, True, "right")
            best = min(best, time.process_time() - started)
        return round(best / len(texts) * 1e6, 1)
    finally:
        pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fronts", default="1,2", help="front counts to compare with the single process")
    ap.add_argument("--engines", default="1", help="engine counts of each split configuration, e.g. 1,2")
    ap.add_argument("--texts", type=int, default=8192, help="texts per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-request", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--per-token-us", type=float, default=0.0, help="the null engine's sleep per padded token")
    ap.add_argument("--model-engine", action="store_true", help="run the real model instead of the null engine")
    ap.add_argument("--packed", choices=("no", "both"), default="no",
                    help="both: every configuration also with the null engine declaring packed sequences")
    ap.add_argument("--server-cpus", default="0", help="CPUs of the servers, e.g. 0 or 0-13")
    ap.add_argument("--load-cpus", default="1", help="CPUs of the load generator")
    ap.add_argument("--baseline-tree", type=Path,
                    help="a checkout of another commit: every configuration also runs from it (baseline_*)")
    add_results_dir(ap, "split-serving-cpu.jsonl")
    args = ap.parse_args()
    meta = run_meta()  # before this process is confined to the load's CPUs: the row names the machine's cores
    os.sched_setaffinity(0, cpu_list(args.load_cpus))
    texts = corpus(args.texts)
    counts = [0, *(int(n) for n in args.fronts.split(","))]
    if args.packed == "both" and args.model_engine:
        sys.exit("--packed both needs the null engine (the model engine packs or pads as the model allows)")
    engines = [int(m) for m in args.engines.split(",")]
    configs = {f"fronts_{n}": (n, False, 1) for n in counts}
    configs |= {f"fronts_{n}_engines_{m}": (n, False, m) for n in counts if n for m in engines if m > 1}
    if args.packed == "both":
        configs |= {f"packed_{name}": (n, True, m) for name, (n, _, m) in configs.items()}
    trees = {name: ROOT for name in configs}
    if args.baseline_tree is not None:
        baseline_checkout(args.baseline_tree)
        # each configuration beside its baseline twin, so that the machine's load falls on both alike
        configs = {key: value for name, value in configs.items()
                   for key in (f"baseline_{name}", name)}
        trees |= {name: args.baseline_tree for name in configs if name.startswith("baseline_")}
    with tempfile.TemporaryDirectory() as site_dir:
        Path(site_dir, "sitecustomize.py").write_text(SITE)
        servers = {name: SplitServer(n, cpu_list(args.server_cpus), site_dir, not args.model_engine,
                                     args.per_token_us * 1e-6, packed, trees[name], m)
                   for name, (n, packed, m) in configs.items()}
        try:
            for server in servers.values():
                measure(server, texts[:2048], args.per_request, args.concurrency)
            rounds: dict[str, list[dict]] = {name: [] for name in configs}
            for _ in range(args.rounds):
                for name, server in servers.items():
                    rounds[name].append(measure(server, texts, args.per_request, args.concurrency))
                    time.sleep(0.5)
        finally:
            for server in servers.values():
                server.stop()
    tokenizer = tokenizer_cpu_ms_per_1k(texts, args.per_request)
    figures = {name: summary(r) for name, r in rounds.items()}
    for figure in figures.values():
        figure["rest_cpu_ms_per_1k"] = round(figure["server_cpu_ms_per_1k"] - tokenizer, 1)
    for name, figure in figures.items():
        single = figures["baseline_fronts_0" if name.startswith("baseline_") else "fronts_0"]
        if figure is not single:
            figure["ratio"] = round(figure["embeddings_per_s"] / single["embeddings_per_s"], 3)
            figure["cpu_ratio"] = round(figure["server_cpu_ms_per_1k"] / single["server_cpu_ms_per_1k"], 3)
            figure["rest_cpu_ratio"] = round(figure["rest_cpu_ms_per_1k"] / single["rest_cpu_ms_per_1k"], 3)
            figure["rest_in_server_ratio"] = round(
                figure["rest_in_server_cpu_ms_per_1k"] / single["rest_in_server_cpu_ms_per_1k"], 3)
    for name, figure in figures.items():
        base = figures.get(f"baseline_{name}")
        if base is not None:
            figure["over_baseline"] = over(figure, base)
    row = {"bench": "split_serving", "engine": "model" if args.model_engine else "null",
           "packed": args.packed, "tokenizer_cpu_ms_per_1k": tokenizer,
           **({"baseline_commit": commit_of(args.baseline_tree)} if args.baseline_tree is not None else {}),
           "per_token_us": args.per_token_us, "baseline": "fronts_0 (the single-process server), same run",
           **figures, "texts_per_round": args.texts, "rounds": args.rounds, "per_request": args.per_request,
           "concurrency": args.concurrency, "server_cpus": args.server_cpus, "load_cpus": args.load_cpus,
           "engines": engines,
           "encoding_format": "base64"}
    print(row)
    record("split-serving", row, results_dir=args.results_dir, meta=meta)


if __name__ == "__main__":
    main()
