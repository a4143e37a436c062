"""`embedfleet embed` end to end vs Baseten's client doing the same backfill in-process, one JSON line
(also appended to bench/results/backfill_cli-cpu.jsonl).

    python bench/backfill_cli.py [--n 100000] [--batch-size 128] [--concurrency 32] [--rounds 3]

Both contenders turn the same JSONL file of `--n` texts into Parquet shards of `--shard-size` rows
(columns `row` int64 and `embedding` fixed_size_list<float32>[384]) through the same instant stub
server (bench/client.py's: precomputed bodies, pinned to CPU 0), with the same batch size and
requests in flight, each in its own process pinned to CPU 1, in the same run:

  ours      `python -m embedfleet.runtime.cli embed ...` as a subprocess; the time includes process
            start-up, imports, the validation pass, fsyncs, sha256s and the manifest
  baseline  baseten-performance-client in an already warm process: read the JSONL (orjson), then per
            shard one `PerformanceClient.embed` (requests on its own Rust threads; a little faster
            than one call over all texts when we tried both), `.numpy()`, `pq.write_table` with the
            same options as ours, without fsync or a manifest. Floats on the wire: its `.numpy()`
            cannot decode base64 (as in bench/client.py).

`ratio` = best baseline seconds / best ours seconds (goal >= 1.5); each round's own ratio is listed
too, so the spread on a shared machine is visible. `correct`: both outputs hold the same vectors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import add_results_dir, record

ROOT = Path(__file__).resolve().parent.parent
CLIENT_BENCH = ROOT / "bench" / "client.py"
STUB_CPU, CLIENT_CPU = 0, 1
PARQUET_OPTIONS: dict[str, Any] = {
    "use_dictionary": False,
    "compression": {"row": "snappy", "embedding": "none"},
    "write_statistics": ["row"],
}


def write_input(path: Path, n: int) -> None:
    import orjson

    with open(path, "wb") as f:
        f.write(b"".join(orjson.dumps({"id": i, "text": f"short input number {i}"}) + b"\n" for i in range(n)))


def _pin() -> None:
    if hasattr(os, "sched_setaffinity") and CLIENT_CPU < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {CLIENT_CPU})


def run_ours(src: Path, out: Path, url: str, args: argparse.Namespace, env: dict[str, str]) -> float:
    cmd = [sys.executable, "-m", "embedfleet.runtime.cli", "embed", str(src), "--url", url, "--out", str(out)]
    cmd += ["--batch-size", str(args.batch_size), "--max-concurrent-requests", str(args.concurrency)]
    cmd += ["--shard-size", str(args.shard_size)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=_pin, timeout=1800)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"embedfleet embed exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return seconds


def baseline(src: str, out: str, url: str, batch_size: int, concurrency: int, shard_size: int) -> float:
    """What a user writes with Baseten's client: read the file, then embed and write shard by shard."""
    import numpy as np
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq
    from baseten_performance_client import PerformanceClient, RequestProcessingPreference

    _pin()
    client = PerformanceClient(base_url=url, api_key="bench")
    pref = RequestProcessingPreference(
        batch_size=batch_size, max_concurrent_requests=concurrency, max_chars_per_request=10**6
    )
    client.embed(["warm up"] * batch_size, model="bench", preference=pref)  # connections, imports
    t0 = time.perf_counter()
    with open(src, "rb") as f:
        texts = [orjson.loads(line)["text"] for line in f if line.strip()]
    os.makedirs(out, exist_ok=True)
    for number, start in enumerate(range(0, len(texts), shard_size)):
        part = client.embed(texts[start : start + shard_size], model="bench", preference=pref).numpy()
        part = np.ascontiguousarray(part, dtype=np.float32)
        table = pa.table(
            {
                "row": pa.array(np.arange(start, start + len(part), dtype=np.int64)),
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), part.shape[1]),
            }
        )
        pq.write_table(table, os.path.join(out, f"part-{number:05d}.parquet"), **PARQUET_OPTIONS)
    return time.perf_counter() - t0


def run_baseline(src: Path, out: Path, url: str, args: argparse.Namespace, env: dict[str, str]) -> float:
    cmd = [sys.executable, __file__, "--baseline", str(src), str(out), url]
    cmd += ["--batch-size", str(args.batch_size), "--concurrency", str(args.concurrency)]
    cmd += ["--shard-size", str(args.shard_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"baseline exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])


def same_vectors(ours: Path, theirs: Path) -> bool:
    import numpy as np
    import pyarrow.parquet as pq

    from embedfleet.client.shards import read_output, read_shard

    mine = read_output(str(ours))
    parts = sorted(theirs.glob("part-*.parquet"))
    other = np.concatenate([read_shard(str(p)) for p in parts])
    rows = np.concatenate([pq.read_table(p, columns=["row"]).column("row").to_numpy() for p in parts])
    return mine.shape == other.shape and bool(np.array_equal(mine, other)) and bool(
        np.array_equal(rows, np.arange(len(rows)))
    )


def warm_stub(url: str, sizes: set[int]) -> None:
    import httpx

    for size in sizes:
        for fmt in ("base64", "float"):
            body = {"input": ["x"] * size, "model": "bench", "encoding_format": fmt}
            httpx.post(url + "/v1/embeddings", json=body, timeout=60).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=10_240, help="a multiple of --batch-size")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both contenders, order alternating")
    parser.add_argument("--baseline", nargs=3, metavar=("SRC", "OUT", "URL"), help=argparse.SUPPRESS)
    add_results_dir(parser, "backfill_cli-cpu.jsonl")
    args = parser.parse_args()
    if args.baseline:
        src, out, url = args.baseline
        seconds = baseline(src, out, url, args.batch_size, args.concurrency, args.shard_size)
        print(json.dumps({"seconds": seconds}))
        return

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "client"), str(ROOT / "runtime"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    sys.path[:0] = [str(ROOT / "client")]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stub = subprocess.Popen([sys.executable, str(CLIENT_BENCH), "--serve", str(port)], stdout=subprocess.PIPE, env=env)
    work = Path(tempfile.mkdtemp(prefix="backfill-bench-"))
    ours_s: list[float] = []
    base_s: list[float] = []
    correct = True
    try:
        assert stub.stdout is not None and stub.stdout.readline().strip() == b"ready"
        url = f"http://127.0.0.1:{port}"
        src = work / "in.jsonl"
        write_input(src, args.n)
        bs, shard = args.batch_size, args.shard_size
        tails = {bs, shard % bs, args.n % bs, (args.n % shard) % bs} - {0}
        warm_stub(url, tails)
        for r in range(args.rounds):
            order = ("ours", "baseline") if r % 2 == 0 else ("baseline", "ours")
            for who in order:
                out = work / f"{who}-{r}"
                if who == "ours":
                    ours_s.append(run_ours(src, out, url, args, env))
                else:
                    base_s.append(run_baseline(src, out, url, args, env))
            correct = correct and same_vectors(work / f"ours-{r}", work / f"baseline-{r}")
            for who in order:
                shutil.rmtree(work / f"{who}-{r}", ignore_errors=True)
    finally:
        stub.terminate()
        stub.wait()
        shutil.rmtree(work, ignore_errors=True)

    ratio = round(min(base_s) / min(ours_s), 2)
    line = {
        "bench": "backfill_cli",
        "n": args.n,
        "dim": 384,
        "batch_size": args.batch_size,
        "concurrency": args.concurrency,
        "shard_size": args.shard_size,
        "rounds": args.rounds,
        "cpus": {"stub": STUB_CPU, "client": CLIENT_CPU, "machine": os.cpu_count()},
        "ours_seconds": [round(s, 3) for s in ours_s],
        "baseline_seconds": [round(s, 3) for s in base_s],
        "ours_emb_per_s": round(args.n / min(ours_s)),
        "baseline_emb_per_s": round(args.n / min(base_s)),
        "ratio": ratio,
        "ratio_per_round": [round(b / o, 2) for b, o in zip(base_s, ours_s, strict=True)],
        "ratio_median_round": round(statistics.median(b / o for b, o in zip(base_s, ours_s, strict=True)), 2),
        "correct": correct,
        "goal_ratio>=1.5": ratio >= 1.5,
    }
    print(json.dumps(line))
    record("backfill_cli", line, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
