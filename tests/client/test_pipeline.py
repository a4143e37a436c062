"""The backfill pipeline: same output as one sequential call, bounded under a slow writer, lossless resume."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from embedfleet.client import Client
from embedfleet.client.backfill import BackfillConfig, BackfillSummary, run_backfill
from embedfleet.client.pipeline import chunks_held_bound, pending_chunks
from embedfleet.client.shards import load_manifest, read_output, write_shard
from embedfleet.runtime.cli import main

from .test_cli import assert_clean, expected, make_texts, write_jsonl


def embed(*args: str) -> int:
    return main(["embed", *args, "--no-progress"])


def shard_rows(out: Path) -> np.ndarray:
    """The `row` column of every shard, in shard order."""
    manifest = load_manifest(str(out))
    assert manifest is not None
    files = [manifest.shards[str(i)]["file"] for i in range(manifest.shard_count())]
    return np.concatenate([pq.read_table(out / f, columns=["row"]).column("row").to_numpy() for f in files])


def test_pending_chunks_numbers_and_skips_resumed_shards():
    chunks = list(pending_chunks(iter(["a", "b", "c", "d", "e"]), 2, done={1}))
    assert [(c.number, c.start, c.texts) for c in chunks] == [(0, 0, ["a", "b"]), (2, 4, ["e"])]
    assert chunks_held_bound(2) == 4 and chunks_held_bound(0) == 3


def test_pipelined_output_equals_the_sequential_path(stub, tmp_path):
    items = make_texts(3000)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    common = ["--url", stub.url, "--shard-size", "250", "--batch-size", "32", "--max-concurrent-requests", "8"]
    assert embed(str(src), "--out", str(tmp_path / "piped"), "--shards-in-flight", "4", *common) == 0
    assert embed(str(src), "--out", str(tmp_path / "one"), "--shards-in-flight", "1", *common) == 0
    with Client(stub.url, batch_size=32) as client:
        sequential = client.embed(items)  # one call, no files: the reference
    piped = read_output(str(tmp_path / "piped"))
    np.testing.assert_array_equal(piped, sequential)
    np.testing.assert_array_equal(piped, expected(items))
    np.testing.assert_array_equal(shard_rows(tmp_path / "piped"), np.arange(3000))
    a, b = load_manifest(str(tmp_path / "piped")), load_manifest(str(tmp_path / "one"))
    assert a is not None and b is not None and a.complete and b.complete
    assert {k: v["sha256"] for k, v in a.shards.items()} == {k: v["sha256"] for k, v in b.shards.items()}
    assert_clean(tmp_path / "piped")


def test_npy_output_equals_the_sequential_path(stub, tmp_path):
    items = make_texts(1200)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    args = ["--url", stub.url, "--out", str(tmp_path / "o"), "--format", "npy", "--shard-size", "100"]
    assert embed(str(src), *args, "--batch-size", "16", "--shards-in-flight", "3") == 0
    np.testing.assert_array_equal(read_output(str(tmp_path / "o")), expected(items))


def test_slow_writer_holds_requests_at_the_bound(stub, tmp_path):
    """While the first shard's write is stuck, requests go on for exactly the chunks the bound allows."""
    items = make_texts(1000)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    release = threading.Event()
    writes: list[int] = []

    def stuck_writer(directory: str, number: int, start: int, vectors: np.ndarray, fmt: str) -> dict[str, Any]:
        writes.append(number)
        if len(writes) == 1:
            assert release.wait(60), "the test never released the writer"
        return write_shard(directory, number, start, vectors, fmt)

    cfg = BackfillConfig(
        input=str(src),
        out=str(tmp_path / "out"),
        urls=[stub.url],
        shard_size=50,
        batch_size=25,
        max_concurrent_requests=4,
        shards_in_flight=2,
    )
    result: list[BackfillSummary | BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(run_backfill(cfg, writer=stuck_writer)))
        except BaseException as exc:  # handed to the test thread below
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        # The shard being written plus `shards_in_flight` embedded ones: 3 chunks of 2 requests.
        deadline = time.monotonic() + 60
        while stub.count < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stub.count == 6
        assert writes == [writes[0]]  # all of that happened while the first write was stuck
    finally:
        release.set()
        thread.join(120)
    summary = result[0]
    assert isinstance(summary, BackfillSummary), summary
    assert summary.chunk_bound == 4 and 3 <= summary.peak_chunks_held <= summary.chunk_bound
    assert stub.count == 40 and sorted(writes) == list(range(20))
    np.testing.assert_array_equal(read_output(cfg.out), expected(items))


def test_failure_mid_run_resumes_without_loss_or_duplicates(stub, tmp_path, capsys):
    items = make_texts(2000)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    args = [str(src), "--url", stub.url, "--out", str(out), "--shard-size", "100", "--batch-size", "25"]
    args += ["--max-concurrent-requests", "1", "--shards-in-flight", "3"]
    # 30 requests go through (7.5 shards' worth, spread over the shards in flight), then every request fails.
    stub.control(faults=[{"kind": "slow", "times": 30, "delay": 0}, {"kind": "status", "status": 400, "times": -1}])
    assert embed(*args) == 1
    err = capsys.readouterr().err
    assert "injected 400" in err and "--resume" in err
    assert_clean(out)
    partial = load_manifest(str(out))
    assert partial is not None and not partial.complete and 1 <= len(partial.shards) < 20
    for key, entry in partial.shards.items():  # every recorded shard is whole and where it belongs
        assert (entry["start"], entry["stop"]) == (int(key) * 100, int(key) * 100 + 100)

    stub.control(reset=True)
    assert embed(*args, "--resume") == 0
    assert stub.count == (20 - len(partial.shards)) * 4  # written shards are not embedded again
    done = load_manifest(str(out))
    assert done is not None and done.complete
    assert {k: v["sha256"] for k, v in partial.shards.items()} == {k: done.shards[k]["sha256"] for k in partial.shards}
    np.testing.assert_array_equal(shard_rows(out), np.arange(2000))  # no row lost, none twice
    np.testing.assert_array_equal(read_output(str(out)), expected(items))
    assert_clean(out)


def test_shards_in_flight_below_one_is_refused(stub, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", make_texts(3))
    assert embed(str(src), "--url", stub.url, "--out", str(tmp_path / "o"), "--shards-in-flight", "0") == 2
    assert "--shards-in-flight must be >= 1" in capsys.readouterr().err
    assert stub.count == 0
