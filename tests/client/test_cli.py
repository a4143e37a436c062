"""`embedfleet embed`: the backfill CLI, in-process and as a real process (kill, Ctrl-C, resume)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedfleet.client.shards import MANIFEST, load_manifest, read_output
from embedfleet.runtime.cli import main
from tests.procs import child_env, spawn

from .stub_server import vector_for


def make_texts(n: int) -> list[str]:
    return [f"document {i} about topic {i % 7}" for i in range(n)]


def write_jsonl(path: Path, items: list[str]) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"id": i, "text": t}) + b"\n" for i, t in enumerate(items)))
    return path


def expected(items: list[str]) -> np.ndarray:
    return np.stack([vector_for(t) for t in items])


def embed(*args: str) -> int:
    return main(["embed", *args, "--no-progress"])


def assert_clean(out: Path) -> None:
    """Only whole shards the manifest names, and no temporary files, are in `out`."""
    manifest = load_manifest(str(out))
    assert manifest is not None
    listed = {e["file"] for e in manifest.shards.values()}
    present = {p.name for p in out.iterdir()} - {MANIFEST}
    assert present == listed
    for entry in manifest.shards.values():
        assert (out / entry["file"]).stat().st_size == entry["bytes"]


def test_jsonl_to_parquet(stub, tmp_path, capsys):
    items = make_texts(230)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    assert (
        embed(str(src), "--url", stub.url, "--out", str(out), "--shard-size", "100", "--batch-size", "16")
        == 0
    )
    np.testing.assert_array_equal(read_output(str(out)), expected(items))
    rows = pq.read_table(out / "part-00002.parquet").column("row").to_pylist()
    assert rows == list(range(200, 230))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("embedfleet embed: done: 230/230 rows") and "3 shards written" in line


def test_text_and_parquet_inputs_to_npy(stub, tmp_path):
    items = make_texts(45)
    txt = tmp_path / "in.txt"
    txt.write_text("\n".join(items) + "\n")
    assert (
        embed(
            str(txt), "--url", stub.url, "--out", str(tmp_path / "a"), "--format", "npy", "--shard-size", "20"
        )
        == 0
    )
    np.testing.assert_array_equal(read_output(str(tmp_path / "a")), expected(items))
    assert sorted(p.name for p in (tmp_path / "a").glob("*.npy")) == [
        "part-00000.npy",
        "part-00001.npy",
        "part-00002.npy",
    ]
    pq.write_table(pa.table({"body": items}), tmp_path / "in.parquet")
    args = [
        str(tmp_path / "in.parquet"),
        "--url",
        stub.url,
        "--out",
        str(tmp_path / "b"),
        "--text-field",
        "body",
    ]
    assert embed(*args) == 0
    np.testing.assert_array_equal(read_output(str(tmp_path / "b")), expected(items))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"text": "ok"}\n{"text": "fine"}\n{"text": \n', "line 3 is not valid JSON"),
        (b'{"text": "ok"}\n{"body": "x"}\n', "line 2 has no field 'text'"),
        (b'{"text": "ok"}\n{"text": ""}\n', "line 2 field 'text' is empty"),
        (b'{"text": 5}\n', "line 1 field 'text' is int"),
        (b'{"text": "ok"}\n{"text": "\xff"}\n', "line 2 is not valid UTF-8"),
        (b'{"text": "ok"}\n[1, 2]\n', "line 2 is not a JSON object"),
        (b"", "no texts to embed"),
    ],
)
def test_bad_input_names_the_row_and_writes_nothing(stub, tmp_path, capsys, content, needle):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    assert embed(str(src), "--url", stub.url, "--out", str(tmp_path / "out")) == 2
    assert needle in capsys.readouterr().err
    assert stub.count == 0
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("part-*"))


def test_missing_file_and_occupied_output(stub, tmp_path, capsys):
    assert embed(str(tmp_path / "nope.jsonl"), "--url", stub.url, "--out", str(tmp_path / "o")) == 2
    assert "input file not found" in capsys.readouterr().err
    src = write_jsonl(tmp_path / "in.jsonl", make_texts(3))
    assert embed(str(src), "--url", stub.url, "--out", str(tmp_path / "o")) == 0
    assert embed(str(src), "--url", stub.url, "--out", str(tmp_path / "o")) == 2
    assert "--resume" in capsys.readouterr().err


def test_misbehaving_server_fails_cleanly(stub, tmp_path, capsys):
    items = make_texts(60)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    # The first shard goes through; then the server drops a vector.
    args = [str(src), "--url", stub.url, "--out", str(out), "--shard-size", "20", "--batch-size", "20"]
    stub.control(faults=[{"kind": "slow", "times": 1, "delay": 0}, {"kind": "wrong_count", "times": -1}])
    code = main(["embed", *args, "--no-progress", "--max-concurrent-requests", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "vectors for 20 inputs" in err and "--resume" in err
    assert_clean(out)
    manifest = load_manifest(str(out))
    assert manifest is not None and not manifest.complete and len(manifest.shards) <= 1
    stub.control(reset=True)
    assert embed(*args, "--resume") == 0
    np.testing.assert_array_equal(read_output(str(out)), expected(items))


def _start_cli(src: Path, out: Path, url: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "embedfleet.runtime.cli", "embed", str(src), "--url", url, "--out", str(out)]
    cmd += ["--shard-size", "50", "--batch-size", "25", "--no-progress", *extra]
    return spawn(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_shards(out: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        manifest = load_manifest(str(out)) if (out / MANIFEST).exists() else None
        if manifest is not None and len(manifest.shards) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the CLI wrote no shards")


def test_resume_after_sigkill_equals_uninterrupted_run(stub, tmp_path):
    items = make_texts(1000)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    full = tmp_path / "full"
    assert (
        embed(str(src), "--url", stub.url, "--out", str(full), "--shard-size", "50", "--batch-size", "25")
        == 0
    )

    out = tmp_path / "killed"
    stub.fault("slow", times=-1, delay=0.2)
    proc = _start_cli(src, out, stub.url)
    _wait_for_shards(out, proc, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = load_manifest(str(out))
    assert partial is not None and 2 <= len(partial.shards) < 20 and not partial.complete

    stub.control(reset=True)
    proc = _start_cli(src, out, stub.url, "--resume")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode()
    assert f"{len(partial.shards)} resumed" in stdout.decode()
    assert stub.count < 40  # the shards already written were not embedded again
    done, reference = load_manifest(str(out)), load_manifest(str(full))
    assert done is not None and reference is not None and done.complete
    assert {k: v["sha256"] for k, v in done.shards.items()} == {
        k: v["sha256"] for k, v in reference.shards.items()
    }
    np.testing.assert_array_equal(read_output(str(out)), read_output(str(full)))
    assert_clean(out)


def test_ctrl_c_keeps_completed_shards(stub, tmp_path):
    items = make_texts(1000)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    stub.fault("slow", times=-1, delay=0.2)
    proc = _start_cli(src, out, stub.url)
    _wait_for_shards(out, proc, 1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr.decode()
    assert "interrupted" in stdout.decode()
    assert_clean(out)
    stub.control(reset=True)
    assert embed(str(src), "--url", stub.url, "--out", str(out), "--shard-size", "50", "--resume") == 0
    np.testing.assert_array_equal(read_output(str(out)), expected(items))


def test_bad_text_and_parquet_inputs_are_named(stub, tmp_path, capsys):
    txt = tmp_path / "in.txt"
    txt.write_bytes(b"one\n\nthree\n")
    assert embed(str(txt), "--url", stub.url, "--out", str(tmp_path / "a")) == 2
    assert "line 2 is empty" in capsys.readouterr().err
    txt.write_bytes(b"one\n\xff\xfe\n")
    assert embed(str(txt), "--url", stub.url, "--out", str(tmp_path / "b")) == 2
    assert "line 2 is not valid UTF-8" in capsys.readouterr().err
    pq.write_table(pa.table({"body": ["a", None]}), tmp_path / "in.parquet")
    assert embed(str(tmp_path / "in.parquet"), "--url", stub.url, "--out", str(tmp_path / "c")) == 2
    assert "no column 'text' (columns: body)" in capsys.readouterr().err
    args = ["--url", stub.url, "--out", str(tmp_path / "d"), "--text-field", "body"]
    assert embed(str(tmp_path / "in.parquet"), *args) == 2
    assert "row 1 column 'body' is null" in capsys.readouterr().err
    assert stub.count == 0
