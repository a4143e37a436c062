"""Node agents authenticate each other (`peer_auth`): `embedfleet cache serve-peers --peer-key-file` as a real
process on 127.0.0.1. A caller without the release's key gets 401 and nothing else; a replayed, stale or
wrongly signed request too; a listing not signed with the key (a spoofed peer, or one altered on the way)
is refused before a byte of a build is fetched."""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from peer_helpers import CLI, Peer, key_file, make_build
from tests.procs import child_env

from embedfleet.operator.cache.engine_fetch import fetch_builds
from embedfleet.operator.cache.engines import list_builds
from embedfleet.operator.cache.peer_auth import NONCE, SIGNATURE, TIME, PeerKey, SignedRequests
from embedfleet.operator.cache.peer_fetch import PeerFailed
from embedfleet.operator.crd import naming

DIGEST = "sha256:" + "7c" * 32
CPU = "cpu-x86_64-avx512vnni"
ENTRY = naming.engines_entry("team-a", DIGEST)
INT8 = f"{CPU}/sha256-7c7c7c7c7c7c7c7c/int8-cpu-0123456789abcdef"


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Peer, PeerKey]]:
    root = tmp_path / "root-a"
    make_build(root / ENTRY, INT8, {"model.bin": os.urandom(4096), "int8.json": b'{"min_cosine": 0.93}'})
    key = key_file(tmp_path)
    peer = Peer(root, key)
    yield peer, PeerKey.from_file(key)
    peer.proc.terminate()
    peer.proc.wait(timeout=30)


def signed(key: PeerKey, path: str, method: str = "GET", at: int | None = None) -> dict[str, str]:
    stamp, nonce = str(int(time.time() if at is None else at)), secrets.token_hex(16)
    return {TIME: stamp, NONCE: nonce, SIGNATURE: key.request_signature(method, path, stamp, nonce)}


def test_only_signed_requests_are_answered(holder, tmp_path: Path) -> None:
    peer, key = holder
    manifest = f"/v1/engines/{ENTRY}/{CPU}/manifest"
    file = f"/v1/engines/{ENTRY}/{INT8.split('/', 1)[0]}/files/{INT8.split('/', 1)[1]}/model.bin"
    weights = f"/v1/entries/team-a_sha256-{'7c' * 32}/manifest"
    other = PeerKey(b"o" * 48)
    for path in (manifest, file, weights):
        for headers in ({}, signed(other, path), signed(key, path + "x"), signed(key, path, "POST"),
                        signed(key, path, at=time.time() - 3600)):
            answer = httpx.get(peer.url + path, headers=headers, timeout=10)
            assert answer.status_code == 401, (path, headers)
            assert answer.content == b"peer credentials required\n"
        assert httpx.post(peer.url + path, timeout=10).status_code == 401
    assert httpx.get(peer.url + "/healthz", timeout=10).status_code == 200  # the kubelet's, no data
    good = signed(key, manifest)
    assert httpx.get(peer.url + manifest, headers=good, timeout=10).status_code == 200
    assert httpx.get(peer.url + manifest, headers=good, timeout=10).status_code == 401  # replayed
    assert httpx.get(peer.url + file, headers=signed(key, file), timeout=10).status_code == 200
    # with the key, the agent's own fetch copies the build
    mine = tmp_path / "root-b" / ENTRY
    mine.mkdir(parents=True)
    assert [b.rel for b in fetch_builds(peer.url, ENTRY, CPU, mine, set(), key=key)] == [INT8]
    # and without the key it gets nothing
    other_root = tmp_path / "root-c" / ENTRY
    other_root.mkdir(parents=True)
    with pytest.raises(PeerFailed, match="HTTP 401"):
        fetch_builds(peer.url, ENTRY, CPU, other_root, set())


def test_a_spoofed_peer_is_refused(tmp_path: Path) -> None:
    """A process without the key answering in an agent's place: its listing is not signed, nothing is copied."""
    root = tmp_path / "root-x"
    make_build(root / ENTRY, INT8, {"model.bin": b"poison", "int8.json": b'{"min_cosine": 1.0}'})
    spoof = Peer(root)  # serves anyone, signs nothing
    try:
        mine = tmp_path / "root-b" / ENTRY
        mine.mkdir(parents=True)
        with pytest.raises(PeerFailed, match="not signed"):
            fetch_builds(spoof.url, ENTRY, CPU, mine, set(), key=PeerKey.from_file(key_file(tmp_path)))
        assert list_builds(mine) == [] and not any(mine.rglob("model.bin"))
    finally:
        spoof.proc.terminate()
        spoof.proc.wait(timeout=30)


class _Tamper(BaseHTTPRequestHandler):
    """A man in the middle: forwards to the real agent, headers and all, and rewrites listings on the way back."""

    upstream = ""

    def do_GET(self) -> None:
        answer = httpx.get(self.upstream + self.path, headers={k: v for k, v in self.headers.items()
                                                               if k.lower().startswith("x-embedfleet")})
        body = answer.content
        if self.path.endswith("/manifest"):
            body = body.replace(b"int8-cpu-0123456789abcdef", b"int8-cpu-ffffffffffffffff")
        self.send_response(answer.status_code)
        for name, value in answer.headers.items():
            if name.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_a_listing_altered_on_the_way_is_refused(holder, tmp_path: Path) -> None:
    peer, key = holder
    handler = type("Tamper", (_Tamper,), {"upstream": peer.url})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        mine = tmp_path / "root-b" / ENTRY
        mine.mkdir(parents=True)
        with pytest.raises(PeerFailed, match="not signed"):
            fetch_builds(url, ENTRY, CPU, mine, set(), key=key)
        assert list_builds(mine) == []
        # the same path, untouched, verifies: the signature covers the body for this request
        with httpx.Client(auth=SignedRequests(key)) as client:
            answer = client.get(f"{peer.url}/v1/engines/{ENTRY}/{CPU}/manifest")
            assert answer.status_code == 200 and client.auth.verify(answer)
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_an_agent_serving_peers_needs_the_key(tmp_path: Path) -> None:
    base = [*CLI, "agent", "--node-name", "n1", "--cache-root", str(tmp_path), "--once", "--peer-port", "8476"]
    done = subprocess.run(base, env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--peer-port needs --peer-key-file" in done.stderr
    (tmp_path / "short.key").write_text("too short")
    done = subprocess.run([*base, "--peer-key-file", str(tmp_path / "short.key")], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "at least 32 bytes" in done.stderr
