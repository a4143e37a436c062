"""What the node agent's peer server refuses to serve, asked over raw HTTP (so no client normalises a path):
anything outside complete, verified entries and the files their manifests list."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from peer_helpers import CLI, NS, Peer, model
from tests.procs import child_env, stop_process

from embedfleet.operator.cache.digest import manifest_lines, render_manifest, tree_digest
from embedfleet.operator.crd import naming


def _entry(root: Path, namespace: str, ready: bool = True) -> tuple[str, str]:
    """A cache entry as the puller leaves it; returns (entry name, digest)."""
    tmp = root / ".build"
    digest = model(tmp)
    (tmp / ".manifest").write_bytes(render_manifest(manifest_lines(tmp)))
    if ready:
        (tmp / ".ready").write_text(digest + "\n")
    (tmp / ".source.json").write_text('{"source": "origin"}\n')
    name = naming.cache_entry(namespace, digest)
    tmp.rename(root / name)
    return name, digest


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Peer, str, str]]:
    root = tmp_path / "root"
    root.mkdir()
    (root / "secret.txt").write_text("not an entry")
    (root / ".agent-state.json").write_text("{}")
    name, digest = _entry(root, NS)
    peer = Peer(root)
    yield peer, name, digest
    stop_process(peer.proc)


def get(peer: Peer, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", peer.port, timeout=10)
    try:
        conn.request(method, path)  # sent as written: no normalisation of .. or %2e
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_the_manifest_lists_each_file_with_size_and_sha256(served: tuple[Peer, str, str]) -> None:
    peer, name, digest = served
    status, body = get(peer, f"/v1/entries/{name}/manifest")
    assert status == 200
    doc = json.loads(body)
    assert doc["digest"] == digest and doc["entry"] == name
    entry = peer.root / name
    assert sorted((f["path"], f["size"]) for f in doc["files"]) == sorted(
        (rel, (entry / rel).stat().st_size) for _, rel in manifest_lines(entry))
    assert render_manifest([(f["sha256"], f["path"]) for f in doc["files"]]) == (entry / ".manifest").read_bytes()
    status, body = get(peer, f"/v1/entries/{name}/files/sub/tokenizer.json")
    assert status == 200 and body == (entry / "sub" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("path", [
    "/v1/entries/{name}/files/.ready",
    "/v1/entries/{name}/files/.manifest",
    "/v1/entries/{name}/files/.source.json",
    "/v1/entries/{name}/files/../secret.txt",
    "/v1/entries/{name}/files/%2e%2e/secret.txt",
    "/v1/entries/{name}/files/sub/../../secret.txt",
    "/v1/entries/{name}/files//etc/passwd",
    "/v1/entries/{name}/files/nothing-here",
    "/v1/entries/../manifest",
    "/v1/entries/%2e%2e/files/root/secret.txt",
    "/v1/entries/secret.txt/manifest",
    "/v1/entries/.agent-state.json/manifest",
    "/v1/entries/sha256-{hex}/manifest",  # the tenant-less layout is never served
    "/v1/entries/other-team_sha256-{hex}/manifest",  # the same digest, another tenant: not held here
    "/secret.txt",
])
def test_nothing_outside_listed_files_of_complete_entries_is_served(served: tuple[Peer, str, str],
                                                                    path: str) -> None:
    peer, name, digest = served
    status, body = get(peer, path.format(name=name, hex=digest.removeprefix("sha256:")))
    assert status in (400, 404), (status, body[:200])
    assert b"not an entry" not in body and b"root:" not in body


def test_an_entry_being_pulled_or_not_what_its_name_says_is_not_served(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    partial, _ = _entry(root, "team-b", ready=False)
    wrong, _ = _entry(root, "team-c")
    (root / wrong / ".ready").write_text("sha256:" + "1" * 64 + "\n")  # names other weights
    linked, digest = _entry(root, "team-d")
    os.symlink(root / linked, root / naming.cache_entry("team-e", digest))
    escaping, _ = _entry(root, "team-f")
    (root / escaping / "config.json").unlink()
    os.symlink("/etc/passwd", root / escaping / "config.json")  # listed in the manifest, now a link out
    tmp_build = root / ".tmp-0123456789ab-x"
    tmp_build.mkdir()
    peer = Peer(root)
    try:
        for name in (partial, wrong, naming.cache_entry("team-e", digest), tmp_build.name):
            assert get(peer, f"/v1/entries/{name}/manifest")[0] == 404, name
            assert get(peer, f"/v1/entries/{name}/files/config.json")[0] == 404, name
        status, body = get(peer, f"/v1/entries/{escaping}/files/config.json")
        assert status == 404 and b"root:" not in body
        assert get(peer, f"/v1/entries/{linked}/files/config.json")[0] == 200  # the real entry is fine
    finally:
        stop_process(peer.proc)


def test_it_is_read_only(served: tuple[Peer, str, str]) -> None:
    peer, name, _ = served
    for method in ("PUT", "POST", "DELETE"):
        assert get(peer, f"/v1/entries/{name}/files/config.json", method)[0] == 405
    assert tree_digest(peer.root / name)  # untouched and still readable


def test_the_serve_peers_command_refuses_a_bad_port() -> None:
    done = subprocess.run([*CLI, "serve-peers", "--cache-root", "/tmp", "--port", "70000"], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "TCP port" in done.stderr
