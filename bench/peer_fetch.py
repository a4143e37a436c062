"""Peer fetch vs origin fetch of one cache entry, both over loopback, in GB/s.

A synthetic model folder (``--mb`` of weights in a few files, random bytes, plus a config) is published
with its SHA256SUMS by Python's ``http.server`` in its own process: the origin. Node A pulls it from
there (`pull`, as the agent does: every file checked against its line, the tree digest checked, the
manifest written, published by rename). Node A's `embedfleet cache serve-peers` (aiohttp, sendfile) then
serves the entry, and node B pulls it from that peer (the peer's manifest checked against the digest,
every file's size and sha256 checked while it streams, the manifest written, published). Each figure is
the pull's wall time, verification and publication included, and the bytes of the entry; the servers
are separate processes, the puller is this one. Both loopback on one machine: the figures compare the
two paths' software, not two networks. Measured twice: caches on the system's temp folder (disk), then
on /dev/shm (tmpfs), where the disk's write speed no longer bounds both.

Prints one JSON line, also appended to bench/results/peer_fetch-cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _common import SOURCE_PATHS, add_results_dir, free_port, record
from embedfleet.operator.cache.digest import MANIFEST_NAME, manifest_lines, render_manifest, tree_digest
from embedfleet.operator.cache.pull import pull
from embedfleet.operator.crd import naming

NAMESPACE = "bench"


def _model(directory: Path, megabytes: int) -> int:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"hidden_size": 1024}')
    shards = 4
    size = megabytes * (1 << 20) // shards
    for i in range(shards):
        with open(directory / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as fh:
            for _ in range(size // (1 << 20)):
                fh.write(os.urandom(1 << 20))
    (directory / MANIFEST_NAME).write_bytes(render_manifest(manifest_lines(directory)))
    return sum(p.stat().st_size for p in directory.iterdir() if p.name != MANIFEST_NAME)


def _wait(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "a server exited"
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(url)


def measure(base: str | None, megabytes: int, env: dict[str, str]) -> dict[str, float | int]:
    """Origin then peer pull of one synthetic entry, the caches under ``base`` (None: the system's temp)."""
    with tempfile.TemporaryDirectory(prefix="peer-bench-", dir=base) as tmp_name:
        tmp = Path(tmp_name)
        size = _model(tmp / "model", megabytes)
        digest = tree_digest(tmp / "model")
        entry = naming.cache_entry(NAMESPACE, digest)
        origin_port, peer_port = free_port(), free_port()
        origin = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
                                   str(tmp), str(origin_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peer = None
        try:
            _wait(f"http://127.0.0.1:{origin_port}/", origin)
            started = time.monotonic()
            got = pull(f"http://127.0.0.1:{origin_port}/model/", digest, tmp / "node-a", retries=0, entry=entry)
            origin_s = time.monotonic() - started
            assert got.source == "origin", got
            peer = subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", "cache", "serve-peers",
                                     "--cache-root", str(tmp / "node-a"), "--port", str(peer_port)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait(f"http://127.0.0.1:{peer_port}/healthz", peer)
            started = time.monotonic()
            got = pull("http://127.0.0.1:1/unused/", digest, tmp / "node-b", retries=0, entry=entry,
                       peers=[f"http://127.0.0.1:{peer_port}"])
            peer_s = time.monotonic() - started
            assert got.source == "peer", got
            assert tree_digest(tmp / "node-b" / entry) == digest
        finally:
            for proc in (origin, peer):
                if proc is not None:
                    proc.terminate()
                    proc.wait(timeout=30)
    return {"entry_bytes": size, "origin_s": round(origin_s, 3), "origin_gb_s": round(size / origin_s / 1e9, 3),
            "peer_s": round(peer_s, 3), "peer_gb_s": round(size / peer_s / 1e9, 3),
            "peer_over_origin": round(origin_s / peer_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="megabytes of weights (default 256)")
    add_results_dir(parser, "peer_fetch-cpu.jsonl")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS))
    result: dict[str, object] = {
        "bench": "peer_fetch",
        "network": "loopback (127.0.0.1) for both: origin = python -m http.server, peer = embedfleet cache "
                   "serve-peers; the puller verifies every file and publishes the entry in both",
        "disk": measure(None, args.mb, env),
    }
    if Path("/dev/shm").is_dir():
        result["tmpfs"] = measure("/dev/shm", args.mb, env)  # the same without the disk's write speed
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                         "python": sys.version.split()[0]}
    line = json.dumps(result)
    print(line)
    record("peer_fetch", result, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
