"""Shared by the benchmark scripts: a deterministic corpus, a server process, and the results logs."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SOURCE_PATHS = [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT / "client"), str(ROOT / "gateway")]
sys.path[:0] = SOURCE_PATHS


def corpus(n: int = 10_000, seed: int = 0) -> list[str]:
    """Short queries and long passages interleaved in their natural (unsorted) order."""
    from embedfleet.runtime.settings import default_model_dir

    vocab = [w for w in (default_model_dir() / "vocab.txt").read_text().split("\n")[2000:12000]
             if w.isalpha()]
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        r = rng.random()
        words = rng.randint(3, 12) if r < 0.5 else rng.randint(20, 60) if r < 0.75 else rng.randint(80, 220)
        texts.append(" ".join(rng.choice(vocab) for _ in range(words)))
    return texts


CODE_PATHS = ("runtime", "operator", "client", "gateway", "bench")  # what a row's figures come from


def run_meta() -> dict:
    """What a results row says of where it came from: the commit (git, or EMBEDFLEET_COMMIT where the tree
    travelled without its .git, as to a GPU machine), with "+dirty" when the code had uncommitted changes,
    the machine (CPU model, cores), the date, the command.
    The tree is named as safe to git, so that a bench run as root on a user's checkout (the real-node ones,
    under sudo) still finds its commit."""
    import platform

    commit = os.environ.get("EMBEDFLEET_COMMIT", "")
    if not commit:
        git = ["git", "-c", f"safe.directory={ROOT}", "-C", str(ROOT)]
        try:
            commit = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip()
            changed = subprocess.run([*git, "status", "--porcelain", "--", *CODE_PATHS, ":!bench/results"],
                                     capture_output=True, text=True, timeout=10).stdout.strip()
            if commit and changed:  # the code measured is not the commit's: the row must not say it is
                commit += "+dirty"
        except (OSError, subprocess.SubprocessError):
            commit = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        cpu = platform.processor() or "unknown"
    return {"commit": commit or "unknown", "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def record(bench: str, row: dict, device: str = "cpu", results_dir: Path | None = None,
           meta: dict | None = None) -> Path:
    """Append `row` with run_meta() as one JSON line to `<results_dir>/<bench>-<device>.jsonl` (bench/results by
    default; device "" names the file by `bench` alone, as bench/gpu.py's `<gpu-name>.jsonl`); returns the path.

    A log, not a snapshot: a rewritten file loses the earlier runs and the figures the docs quote from them,
    so the file is only ever opened for appending. run_meta's keys are the run's own (which tree, machine,
    date and command produced the row); where the row already has one of them with another value (a bench's
    own `cpu` or `cores` label), both are kept, the row's as `bench_<key>`. A bench that appends several rows
    of one run passes one run_meta() as `meta`, so that they share its date: the date tells runs apart."""
    out = dict(row)
    for key, value in (run_meta() if meta is None else meta).items():
        if key in out and out[key] != value:
            out[f"bench_{key}"] = out[key]
        out[key] = value
    folder = RESULTS if results_dir is None else Path(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"{bench}-{device}.jsonl" if device else f"{bench}.jsonl")
    with path.open("a+b") as f:  # a+: every write lands at the end, whatever was read before
        end = f.seek(0, os.SEEK_END)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":  # a hand-edited file without its last newline: this row on a line of its own
                f.write(b"\n")
        f.write(json.dumps(out).encode() + b"\n")
    return path


def add_results_dir(parser: argparse.ArgumentParser, log: str) -> None:
    """The `--results-dir` every bench takes: the folder whose `log` (the file its record() call names, such
    as `gateway-cpu.jsonl`) the run appends its row to. bench/results by default, since a run is a row there;
    a trial run that should not count goes elsewhere (`--results-dir /tmp/x`)."""
    parser.add_argument("--results-dir", type=Path, default=RESULTS, metavar="DIR",
                        help=f"append the run's row to {log} in DIR (default: bench/results; a trial run: "
                             "another folder, e.g. /tmp/x)")


def gpu_log_name(gpu: str) -> str:
    """A GPU's name as a results file spells it: torch.cuda.get_device_name() with every run of characters
    other than letters and digits as one "-" ("NVIDIA H200" -> "NVIDIA-H200")."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")


def device_name(device: str = "cpu") -> str:
    """record()'s `device` for a bench that ran on torch device `device`: "cpu", or on CUDA the GPU's name
    (gpu_log_name), so that one GPU's rows share a file and never land in a -cpu log."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    return gpu_log_name(torch.cuda.get_device_name(torch.device(device)))


def read_rows(path: Path | str) -> list[dict]:
    """Every row of a results file, in order. Reads the JSON-lines logs record() appends to and, so that a copy
    of an older tree or an outside file still reads, a file holding one JSON object (indented or not)."""
    text = Path(path).read_text()
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError:
        rows = [json.loads(text)]
    if not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path}: a results row is a JSON object")
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned_to(cpus: set[int] | None):
    """A `preexec_fn` that confines the child (and every thread it starts) to `cpus`; None: no pinning.
    Benchmarks use it to give processes that would run on separate machines their own cores."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


class Server:
    """`embedfleet serve` as a user starts it (on `cpus` only, when given: it then sizes its threads
    to them, as it does to a container's CPU set)."""

    def __init__(self, *flags: str, cpus: set[int] | None = None, log_file: Path | None = None) -> None:
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS), HF_HUB_OFFLINE="1")
        sink = open(log_file, "ab") if log_file is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "info" if log_file is not None else "warning", *flags],
            env=env, stdout=sink, stderr=sink, preexec_fn=pinned_to(cpus))
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait_ready(self.url, self.proc)
        except BaseException:  # never leave a server behind when it did not come up
            self.proc.kill()
            self.proc.wait(30)
            raise

    def stop(self) -> None:
        stop_process(self.proc)

    def card(self) -> dict:
        """The served model's /v1/models entry (dtype served, batching, packed, gate figures)."""
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]


def stop_process(proc: subprocess.Popen) -> None:
    """SIGINT (the server drains and exits), then SIGKILL if it has not within a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def wait_ready(url: str, proc: subprocess.Popen | None = None, path: str = "/ready", timeout: float = 300,
               interval: float = 0.25) -> None:
    """Poll `url + path` every `interval` seconds until it answers 200 (one connection, kept: a start-up
    bench polls every 10 ms, and a new connection per poll would cost the server it measures)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if client.get(url + path).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(interval)
    raise TimeoutError(f"{url} not ready in {timeout:g} s")


def thread_cpu_seconds(pid: int) -> tuple[float, float]:
    """(the main thread's, all other threads') CPU seconds of a process so far, from /proc: for the server,
    its event loop against its tokenizer, engine and library threads. (0, 0) once the process is gone."""
    kinds = thread_cpu_by_kind(pid)
    main = kinds.pop("loop", 0.0)
    return main, sum(kinds.values())


# Python code a bench's server runs before the runtime: every Python thread named "engine..." or "tokenizer..."
# carries that kind as its OS name from its start, as the runtime now names its own (core/engine_thread.py).
# A baseline tree older than that names none, so its engine thread would count as a library thread and its
# rest less the tokenizer would leave its engine thread out, where this tree's counts it: this makes the two
# alike. HF tokenizers' workers inherit the name of the tokenizer thread that starts them, in either tree.
NAME_THREADS = """
import ctypes as _ctypes, threading as _threading
def _named(run, _prctl=_ctypes.CDLL(None).prctl):
    def named_run(self):
        kind = next((k for k in ("engine", "tokenizer") if self.name.startswith(k)), None)
        if kind is not None:
            _prctl(15, _ctypes.c_char_p(kind.encode()), 0, 0, 0)
        return run(self)
    return named_run
_threading.Thread.run = _named(_threading.Thread.run)
"""


def thread_cpu_by_kind(pid: int) -> dict[str, float]:
    """CPU seconds of a server process' threads by what they are, from their OS names (the runtime names its
    own: core/engine_thread.py `name_os_thread`): "loop" (the main thread), "engine", "tokenizer" (the
    tokenizer pool's threads, which hand a batch to HF tokenizers), "library" (threads the runtime did not
    name, which keep the process' name: HF tokenizers' Rust workers, torch's OpenMP pool), "other". Nothing
    for a process that is gone.

    Each thread's time on a CPU from the scheduler (`schedstat`, nanoseconds), where the kernel keeps it;
    else utime + stime from `stat`, which the kernel samples at each clock tick (10 ms) and which spread by
    several percent between two runs of the same code here."""
    out: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        process_name = Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return out
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
            try:
                seconds = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (FileNotFoundError, IndexError, ValueError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        kind = ("loop" if task.name == str(pid) else name if name in ("engine", "tokenizer")
                else "library" if name == process_name else "other")
        out[kind] = out.get(kind, 0.0) + seconds
    return out


def source_paths(tree: Path) -> list[str]:
    """SOURCE_PATHS as they are in another checkout `tree` (a baseline's), for its PYTHONPATH."""
    return [str(tree / Path(p).relative_to(ROOT)) for p in SOURCE_PATHS]


def baseline_checkout(tree: Path) -> Path:
    """`tree` if it is a checkout of this repository (what --baseline-tree takes); else exit saying how to make one."""
    if not (tree / "runtime" / "embedfleet").is_dir():
        sys.exit(f"{tree} is not a checkout of this repository: git worktree add {tree} <commit>")
    return tree


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def percentiles(samples: list[float]) -> dict[str, float]:
    import numpy as np

    a = np.array(samples) * 1000
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p90_ms": round(float(np.percentile(a, 90)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3)}


def metric(url: str, name: str) -> float:
    """A server's Prometheus sample `name`, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

