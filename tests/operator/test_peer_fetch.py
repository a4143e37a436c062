"""Weights from a peer node's agent, with real processes on 127.0.0.1: `embedfleet cache serve-peers` over one
cache root (the first node) and `embedfleet cache pull --namespace NS --peer URL` into another (the second
node), a real HTTP origin (file_server.py) counting what it is asked for. What the second node holds is
checked by the runtime's own `verify_entry`; where it came from by its `.source.json`."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from file_server import FileServer, serve_files
from peer_helpers import CLI, NS, Peer, key_file, model
from tests.procs import child_env, free_port, stop_process

from embedfleet.operator.cache.digest import manifest_lines, render_manifest, verify_entry
from embedfleet.operator.crd import naming


def pull(cache: Path, source: str, digest: str, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "pull", "--source", source, "--digest", digest, "--cache-dir", str(cache),
                           "--namespace", NS, "--retries", "1", "--backoff", "0.01", "--timeout", "5",
                           "--peer-key-file", str(key_file(cache.parent)), *extra],
                          env=child_env(), capture_output=True, text=True, timeout=timeout)


def record(cache: Path, digest: str) -> dict:
    return json.loads((cache / naming.cache_entry(NS, digest) / ".source.json").read_text())


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[FileServer, str, str]]:
    """(server, source URL, digest) of a model published as a SHA256SUMS directory."""
    model_dir = tmp_path / "model"
    digest = model(model_dir)
    with serve_files() as server:
        server.publish_dir("/m/", model_dir)
        server.files["/m/SHA256SUMS"] = render_manifest(manifest_lines(model_dir))
        yield server, server.url + "/m/", digest


@pytest.fixture
def first_node(tmp_path: Path, origin: tuple[FileServer, str, str]) -> Iterator[Peer]:
    """The first node: the entry pulled from the origin, its peer server running."""
    _, source, digest = origin
    root = tmp_path / "node-a"
    done = pull(root, source, digest)
    assert done.returncode == 0, done.stderr
    assert record(root, digest)["source"] == "origin"
    peer = Peer(root, key_file(tmp_path))  # every request signed with the release's key (peer_auth)
    yield peer
    stop_process(peer.proc)


def test_the_second_node_fetches_from_the_first_and_verifies_every_file(
        tmp_path: Path, origin: tuple[FileServer, str, str], first_node: Peer) -> None:
    server, source, digest = origin
    asked_origin = len(server.requests)
    second = tmp_path / "node-b"
    done = pull(second, source, digest, "--peer", first_node.url)
    assert done.returncode == 0, done.stderr
    assert "source: peer" in done.stdout
    assert len(server.requests) == asked_origin, "the origin was asked although a peer held the entry"
    entry = second / naming.cache_entry(NS, digest)
    assert verify_entry(entry, digest) == "digest"  # the runtime's own check, files against the digest
    rec = record(second, digest)
    assert rec["source"] == "peer" and rec["from"] == first_node.url
    assert rec["bytes"] == sum(p.stat().st_size for p in (tmp_path / "model").rglob("*") if p.is_file())
    assert rec["seconds"] >= 0
    assert len(first_node.served()) == 3  # three files, each once
    # Again: a cache hit, nothing fetched from anyone.
    again = pull(second, source, digest, "--peer", first_node.url)
    assert again.returncode == 0 and "already cached" in again.stdout and len(first_node.served()) == 3


def test_a_corrupt_peer_is_skipped_and_the_origin_used(
        tmp_path: Path, origin: tuple[FileServer, str, str], first_node: Peer) -> None:
    server, source, digest = origin
    weights = first_node.root / naming.cache_entry(NS, digest) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0xFF  # the disk of the first node rots after its entry was verified
    weights.write_bytes(bytes(data))
    asked_origin = len(server.requests)
    second = tmp_path / "node-b"
    done = pull(second, source, digest, "--peer", first_node.url)
    assert done.returncode == 0, done.stderr
    assert "sha256" in done.stderr and "trying the next source" in done.stderr
    assert record(second, digest)["source"] == "origin"
    assert len(server.requests) > asked_origin
    assert verify_entry(second / naming.cache_entry(NS, digest), digest) == "digest"
    assert not [p for p in second.iterdir() if p.name.startswith(".tmp-")]


def test_a_peer_that_is_down_or_lacks_the_entry_means_the_origin(
        tmp_path: Path, origin: tuple[FileServer, str, str]) -> None:
    _, source, digest = origin
    empty = tmp_path / "empty-node"
    empty.mkdir()
    lacking = Peer(empty, key_file(tmp_path))
    try:
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        second = tmp_path / "node-b"
        started = time.monotonic()
        done = pull(second, source, digest, "--peer", down, "--peer", lacking.url)
        assert done.returncode == 0, done.stderr
        assert "ConnectError" in done.stderr and "HTTP 404" in done.stderr
        assert record(second, digest)["source"] == "origin"
        assert time.monotonic() - started < 30
    finally:
        stop_process(lacking.proc)


def test_the_bandwidth_limit_holds(tmp_path: Path, origin: tuple[FileServer, str, str], first_node: Peer) -> None:
    _, source, digest = origin
    size = sum(p.stat().st_size for p in (tmp_path / "model").rglob("*") if p.is_file())
    rate = 128 * 1024  # bytes/s: 256 KiB of weights take about two seconds
    done = pull(tmp_path / "node-b", source, digest, "--peer", first_node.url, "--peer-rate", str(rate))
    assert done.returncode == 0, done.stderr
    took = record(tmp_path / "node-b", digest)["seconds"]
    assert took >= size / rate * 0.8, f"{size} bytes at {rate} B/s took only {took}s"
    assert took < size / rate * 4 + 5


def test_concurrent_pulls_of_one_entry_download_it_once(
        tmp_path: Path, origin: tuple[FileServer, str, str], first_node: Peer) -> None:
    server, source, digest = origin
    second = tmp_path / "node-b"
    second.mkdir()
    asked_origin = len(server.requests)
    cmd = [*CLI, "pull", "--source", source, "--digest", digest, "--cache-dir", str(second), "--namespace", NS,
           "--peer", first_node.url, "--peer-rate", str(96 * 1024),  # about 3 s: the pulls overlap
           "--peer-key-file", str(key_file(tmp_path))]
    procs = [subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("source: peer" in out for out, _ in outs) == 1, outs
    assert sum("already cached" in out for out, _ in outs) == 2, outs
    assert sum("waiting for it" in err for _, err in outs) >= 1, "the pulls did not overlap: nothing was tested"
    assert len(first_node.served()) == 3 and len(server.requests) == asked_origin
    assert verify_entry(second / naming.cache_entry(NS, digest), digest) == "digest"


def test_an_archive_entry_is_not_taken_from_a_peer(tmp_path: Path) -> None:
    """An archive's digest covers the archive, gone after unpacking: a peer cannot prove what it serves."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    digest = "sha256:" + hashlib.sha256(buf.getvalue()).hexdigest()
    with serve_files() as server:
        server.files["/w.tar.gz"] = buf.getvalue()
        root = tmp_path / "node-a"
        assert pull(root, server.url + "/w.tar.gz", digest).returncode == 0
        peer = Peer(root, key_file(tmp_path))
        try:
            done = pull(tmp_path / "node-b", server.url + "/w.tar.gz", digest, "--peer", peer.url)
            assert done.returncode == 0, done.stderr
            assert "does not prove" in done.stderr
            assert record(tmp_path / "node-b", digest)["source"] == "origin"
            assert peer.served() == []
        finally:
            stop_process(peer.proc)


def test_peer_needs_a_namespace(tmp_path: Path) -> None:
    done = subprocess.run([*CLI, "pull", "--source", "http://127.0.0.1:1/x", "--digest", "sha256:" + "0" * 64,
                           "--cache-dir", str(tmp_path), "--peer", "http://127.0.0.1:2"],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--namespace" in done.stderr
