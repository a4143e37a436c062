"""`embedfleet cache pull` against a real local HTTP server and file:// sources: verification, retries,
size limits, the entry manifest the runtime re-checks, and the node-cache shortcut of runtime pods."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from file_server import FileServer, serve_files

from embedfleet.operator.cache.digest import VerifyError, tree_digest, verify_entry
from embedfleet.operator.cache.pull import entry_path, is_ready
from embedfleet.runtime.cli import main as embedfleet

WEIGHTS = b"\x00\x01fake-safetensors-bytes" * 1000
CONFIG = b'{"hidden_size": 384}'


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def server() -> Iterator[FileServer]:
    with serve_files() as state:
        yield state


def pull(*args: str) -> int:
    return embedfleet(["cache", "pull", "--backoff", "0.01", *args])


def leftovers(cache: Path) -> list[str]:
    return [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")] if cache.exists() else []


# ---------------------------------------------------------------- digest definition


def test_directory_digest_is_sha256_of_sorted_sha256sum_lines(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "model.safetensors").write_bytes(WEIGHTS)
    (tmp_path / "config.json").write_bytes(CONFIG)
    (tmp_path / "sub" / "B.txt").write_bytes(b"b")
    (tmp_path / ".ready").write_text("ignored")
    manifest = "".join(
        f"{hashlib.sha256(data).hexdigest()}  {rel}\n"
        for rel, data in sorted(
            {"model.safetensors": WEIGHTS, "config.json": CONFIG, "sub/B.txt": b"b"}.items(),
            key=lambda kv: kv[0].encode(),
        )
    )
    assert tree_digest(tmp_path) == sha(manifest.encode())
    assert tree_digest(tmp_path / "model.safetensors") == sha(WEIGHTS)


def test_digest_command_and_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_bytes(CONFIG)
    assert embedfleet(["cache", "digest", str(tmp_path), "--write-manifest"]) == 0
    printed = capsys.readouterr().out.strip()
    manifest = (tmp_path / "SHA256SUMS").read_bytes()
    assert printed == sha(manifest) == tree_digest(tmp_path)  # the manifest does not change the digest
    assert embedfleet(["cache", "digest", str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------- http(s)


def test_pull_single_file_over_http(server: FileServer, tmp_path: Path) -> None:
    server.files["/m/model.safetensors"] = WEIGHTS
    digest = sha(WEIGHTS)
    cache = tmp_path / "cache"
    source = server.url + "/m/model.safetensors"
    assert pull("--source", source, "--digest", digest, "--cache-dir", str(cache)) == 0
    entry = entry_path(cache, digest)
    assert (entry / "model.safetensors").read_bytes() == WEIGHTS
    assert (entry / ".ready").read_text().strip() == digest
    assert is_ready(cache, digest)
    # Idempotent: a ready entry is not fetched again.
    assert pull("--source", source, "--digest", digest, "--cache-dir", str(cache)) == 0
    assert server.requests == ["/m/model.safetensors"]
    assert leftovers(cache) == []


def test_pull_directory_with_manifest_over_http(server: FileServer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "onnx").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(WEIGHTS)
    (src / "config.json").write_bytes(CONFIG)
    (src / "onnx" / "model.onnx").write_bytes(b"onnx")
    assert embedfleet(["cache", "digest", str(src), "--write-manifest"]) == 0
    for path in src.rglob("*"):
        if path.is_file():
            server.files["/repo/" + path.relative_to(src).as_posix()] = path.read_bytes()
    digest = tree_digest(src)
    cache = tmp_path / "cache"
    assert pull("--source", server.url + "/repo/", "--digest", digest, "--cache-dir", str(cache)) == 0
    entry = entry_path(cache, digest)
    assert (entry / "onnx" / "model.onnx").read_bytes() == b"onnx"
    assert tree_digest(entry) == digest
    assert is_ready(cache, digest)


def test_pull_archive_is_verified_then_unpacked(server: FileServer, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in {"model.safetensors": WEIGHTS, "config.json": CONFIG}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    server.files["/w.tar.gz"] = buf.getvalue()
    digest = sha(buf.getvalue())
    cache = tmp_path / "cache"
    assert pull("--source", server.url + "/w.tar.gz", "--digest", digest, "--cache-dir", str(cache)) == 0
    entry = entry_path(cache, digest)
    assert sorted(p.name for p in entry.iterdir()) == [".manifest", ".ready", ".source.json", "config.json",
                                                            "model.safetensors"]
    # The manifest records the unpacked tree (the digest covers the archive, which is gone).
    assert (entry / ".manifest").read_text() == (
        f"{sha(CONFIG)[7:]}  config.json\n{sha(WEIGHTS)[7:]}  model.safetensors\n"
    )
    assert verify_entry(entry, digest) == "manifest"


def test_corrupt_download_is_retried_then_succeeds(server: FileServer, tmp_path: Path) -> None:
    server.files["/model.bin"] = WEIGHTS
    server.corrupt["/model.bin"] = 2
    server.fail_500["/model.bin"] = 1
    cache = tmp_path / "cache"
    rc = pull("--source", server.url + "/model.bin", "--digest", sha(WEIGHTS), "--cache-dir", str(cache),
              "--retries", "3")
    assert rc == 0
    assert len(server.requests) == 4  # one 500, two corrupt, one good
    assert (entry_path(cache, sha(WEIGHTS)) / "model.bin").read_bytes() == WEIGHTS


def test_always_corrupt_download_is_refused_and_never_ready(
    server: FileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.files["/model.bin"] = WEIGHTS
    server.corrupt["/model.bin"] = 100
    cache = tmp_path / "cache"
    rc = pull("--source", server.url + "/model.bin", "--digest", sha(WEIGHTS), "--cache-dir", str(cache),
              "--retries", "2")
    assert rc == 1
    assert len(server.requests) == 3
    assert "digest mismatch" in capsys.readouterr().err
    assert not is_ready(cache, sha(WEIGHTS))
    assert not entry_path(cache, sha(WEIGHTS)).exists()
    assert leftovers(cache) == []


def test_tampered_file_in_a_manifest_directory_is_refused(server: FileServer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(CONFIG)
    embedfleet(["cache", "digest", str(src), "--write-manifest"])
    server.files["/d/SHA256SUMS"] = (src / "SHA256SUMS").read_bytes()
    server.files["/d/config.json"] = b'{"hidden_size": 999}'
    cache = tmp_path / "cache"
    assert pull("--source", server.url + "/d/", "--digest", tree_digest(src), "--cache-dir", str(cache),
                "--retries", "1") == 1
    assert not is_ready(cache, tree_digest(src))


def test_missing_file_is_a_clear_permanent_error(server: FileServer, tmp_path: Path) -> None:
    rc = pull("--source", server.url + "/nope.bin", "--digest", sha(b"x"), "--cache-dir", str(tmp_path))
    assert rc == 2
    assert server.requests == ["/nope.bin"]  # a 404 is not retried


# ---------------------------------------------------------------- file:// and refusals


def test_pull_file_directory_and_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(WEIGHTS)
    (src / "config.json").write_bytes(CONFIG)
    cache = tmp_path / "cache"
    digest = tree_digest(src)
    assert pull("--source", f"file://{src}", "--digest", digest, "--cache-dir", str(cache)) == 0
    assert tree_digest(entry_path(cache, digest)) == digest
    one_file = f"file://{src}/config.json"
    assert pull("--source", one_file, "--digest", sha(CONFIG), "--cache-dir", str(cache)) == 0
    assert (entry_path(cache, sha(CONFIG)) / "config.json").read_bytes() == CONFIG


def test_digest_mismatch_is_never_marked_ready(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes(CONFIG)
    wrong = sha(b"something else")
    cache = tmp_path / "cache"
    rc = pull("--source", f"file://{src}", "--digest", wrong, "--cache-dir", str(cache), "--retries", "1")
    assert rc == 1
    assert "not marked ready" in capsys.readouterr().err
    assert not entry_path(cache, wrong).exists()
    assert leftovers(cache) == []


def test_unverified_leftover_is_replaced(tmp_path: Path) -> None:
    src = tmp_path / "w.bin"
    src.write_bytes(WEIGHTS)
    cache = tmp_path / "cache"
    stale = entry_path(cache, sha(WEIGHTS))
    stale.mkdir(parents=True)
    (stale / "w.bin").write_bytes(b"half a download")
    assert pull("--source", f"file://{src}", "--digest", sha(WEIGHTS), "--cache-dir", str(cache)) == 0
    assert (stale / "w.bin").read_bytes() == WEIGHTS and is_ready(cache, sha(WEIGHTS))


@pytest.mark.parametrize(
    ("source", "hint"),
    [
        ("hf://not-a-repo-id", "hf://ORG/NAME"),
        ("s3://bucket/models/minilm", "AWS"),
        ("gs://bucket/models/minilm", "gsutil"),
        ("pvc://claim/models", "mount the claim"),
        ("ftp://host/x", "unsupported source scheme"),
    ],
)
def test_unfetchable_schemes_say_what_is_needed(
    source: str, hint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert pull("--source", source, "--digest", sha(b"x"), "--cache-dir", str(tmp_path)) == 2
    assert hint in capsys.readouterr().err


def test_hf_source_over_the_hub_http_api(server: FileServer, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """hf://org/name@rev lists the revision's files and resolves each; extra weight formats are skipped."""
    import json

    files = {"config.json": CONFIG, "model.safetensors": WEIGHTS, "tokenizer.json": b"{}",
             "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}'}
    skipped = {"onnx/model.onnx": b"onnx", "pytorch_model.bin": b"bin", "README.md": b"# card"}
    server.files["/api/models/org/minilm/revision/v1"] = json.dumps(
        {"sha": "abc123", "siblings": [{"rfilename": n} for n in [*files, *skipped]]}).encode()
    for name, body in {**files, **skipped}.items():
        server.files[f"/org/minilm/resolve/abc123/{name}"] = body
    reference = tmp_path / "reference"
    for name, body in files.items():
        (reference / name).parent.mkdir(parents=True, exist_ok=True)
        (reference / name).write_bytes(body)
    digest = tree_digest(reference)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    cache = tmp_path / "cache"
    server.corrupt["/org/minilm/resolve/abc123/model.safetensors"] = 1  # first try is spoiled, then retried
    assert pull("--source", "hf://org/minilm@v1", "--digest", digest, "--cache-dir", str(cache),
                "--retries", "3") == 0
    entry = entry_path(cache, digest)
    assert is_ready(cache, digest)
    assert sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file()
                  and not p.name.startswith(".")) == sorted(files)
    assert not any("onnx" in r or "pytorch_model.bin" in r for r in server.requests)
    wrong = pull("--source", "hf://org/minilm@v1", "--digest", sha(b"other"), "--cache-dir", str(tmp_path / "c2"),
                 "--retries", "1")
    assert wrong == 1 and not is_ready(tmp_path / "c2", sha(b"other"))


def test_bad_digest_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pull("--source", "file:///x", "--digest", "md5:abc", "--cache-dir", str(tmp_path)) == 2
    assert "sha256:<64 lowercase hex>" in capsys.readouterr().err


# ---------------------------------------------------------------- size limits


def test_max_bytes_refuses_an_announced_large_file_before_reading_it(
    server: FileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.files["/big.bin"] = WEIGHTS
    rc = pull("--source", server.url + "/big.bin", "--digest", sha(WEIGHTS), "--cache-dir", str(tmp_path),
              "--max-bytes", str(len(WEIGHTS) - 1))
    assert rc == 2  # permanent: retrying downloads the same bytes
    assert server.requests == ["/big.bin"]
    assert "Content-Length" in capsys.readouterr().err
    assert not is_ready(tmp_path, sha(WEIGHTS)) and leftovers(tmp_path) == []
    assert pull("--source", server.url + "/big.bin", "--digest", sha(WEIGHTS), "--cache-dir", str(tmp_path),
                "--max-bytes", str(len(WEIGHTS))) == 0


def test_max_bytes_stops_a_stream_without_length_and_counts_all_files(
    server: FileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.files["/big.bin"] = WEIGHTS
    server.no_length.add("/big.bin")
    rc = pull("--source", server.url + "/big.bin", "--digest", sha(WEIGHTS), "--cache-dir", str(tmp_path / "a"),
              "--max-bytes", "4096")
    assert rc == 2 and "more than 4096 bytes" in capsys.readouterr().err
    assert leftovers(tmp_path / "a") == []
    # A directory source: each file is under the limit, together they are not.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(WEIGHTS)
    (src / "b.bin").write_bytes(WEIGHTS[::-1])
    assert embedfleet(["cache", "digest", str(src), "--write-manifest"]) == 0
    server.publish_dir("/d/", src)
    limit = str(len(WEIGHTS) + 500)
    rc = pull("--source", server.url + "/d/", "--digest", tree_digest(src), "--cache-dir", str(tmp_path / "b"),
              "--max-bytes", limit)
    assert rc == 2 and not is_ready(tmp_path / "b", tree_digest(src))


# ---------------------------------------------------------------- node cache shortcut and verification


def test_from_node_cache_links_a_ready_entry_without_fetching(server: FileServer, tmp_path: Path) -> None:
    server.files["/w.bin"] = WEIGHTS
    digest = sha(WEIGHTS)
    node_root = tmp_path / "node-root"
    entry_name = f"ml_sha256-{digest[7:]}"
    assert embedfleet(["cache", "pull", "--source", server.url + "/w.bin", "--digest", digest,
                       "--cache-dir", str(node_root)]) == 0  # fills node_root/sha256-<hex>
    (node_root / f"sha256-{digest[7:]}").rename(node_root / entry_name)
    server.requests.clear()
    local = tmp_path / "local"
    assert pull("--source", server.url + "/w.bin", "--digest", digest, "--cache-dir", str(local),
                "--from-node-cache", str(node_root / entry_name)) == 0
    link = entry_path(local, digest)
    assert link.is_symlink() and link.resolve() == (node_root / entry_name).resolve()
    assert server.requests == []  # no network
    assert verify_entry(link, digest) == "digest"  # a single file: the digest covers it directly


def test_from_node_cache_falls_back_to_pulling_when_the_node_has_nothing(server: FileServer, tmp_path: Path) -> None:
    server.files["/w.bin"] = WEIGHTS
    digest = sha(WEIGHTS)
    empty = tmp_path / "node-entry"
    empty.mkdir()  # what the kubelet creates for a hostPath the agent has not filled yet
    other = tmp_path / "other-entry"
    other.mkdir()
    (other / ".ready").write_text(sha(b"other weights") + "\n")
    for node_entry in (empty, other):
        local = tmp_path / f"local-{node_entry.name}"
        assert pull("--source", server.url + "/w.bin", "--digest", digest, "--cache-dir", str(local),
                    "--from-node-cache", str(node_entry)) == 0
        assert not entry_path(local, digest).is_symlink() and is_ready(local, digest)
    assert server.requests == ["/w.bin", "/w.bin"]


def test_verify_entry_refuses_tampering_and_mixups(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(WEIGHTS)
    (src / "config.json").write_bytes(CONFIG)
    digest = tree_digest(src)
    cache = tmp_path / "cache"
    assert pull("--source", f"file://{src}", "--digest", digest, "--cache-dir", str(cache)) == 0
    entry = entry_path(cache, digest)
    assert verify_entry(entry, digest) == "digest"  # directory source: the manifest hashes to the digest
    with pytest.raises(VerifyError, match="names"):
        verify_entry(entry, sha(b"some other model"))
    os.chmod(entry / "config.json", 0o644)
    (entry / "config.json").write_bytes(b'{"hidden_size": 1}')
    with pytest.raises(VerifyError, match="does not match the manifest"):
        verify_entry(entry, digest)
    (entry / "config.json").write_bytes(CONFIG)
    (entry / "extra.py").write_text("import os")
    with pytest.raises(VerifyError, match="not in the manifest"):
        verify_entry(entry, digest)
    (entry / "extra.py").unlink()
    (entry / "model.safetensors").unlink()
    with pytest.raises(VerifyError, match="missing"):
        verify_entry(entry, digest)
    (entry / ".ready").unlink()
    with pytest.raises(VerifyError, match=r"no \.ready"):
        verify_entry(entry, digest)
