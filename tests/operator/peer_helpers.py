"""Helpers of the peer tests: a small model folder and `embedfleet cache serve-peers` as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tests.procs import child_env, free_port, spawn

from embedfleet.operator.cache.digest import tree_digest

NS = "team-a"
CLI = [sys.executable, "-m", "embedfleet.runtime.cli", "cache"]


def model(directory: Path, weights_bytes: int = 256 * 1024) -> str:
    """A model folder with a nested file; returns its directory digest."""
    (directory / "sub").mkdir(parents=True)
    (directory / "config.json").write_bytes(b'{"hidden_size": 384}')
    (directory / "model.safetensors").write_bytes(os.urandom(weights_bytes))
    (directory / "sub" / "tokenizer.json").write_bytes(b'{"v": 1}')
    return tree_digest(directory)


def key_file(directory: Path) -> Path:
    """The release's peer key as the chart mounts it: one file, here ``directory/peer.key`` (made once)."""
    path = directory / "peer.key"
    if not path.exists():
        path.write_text("k" * 24 + os.urandom(16).hex() + "\n")
    return path


def make_build(folder: Path, rel: str, files: dict[str, bytes] | None = None) -> Path:
    """An engine build as a runtime publishes one: ``folder/<accelerator>/<group>/<build>/`` with its files."""
    path = folder / rel
    path.mkdir(parents=True)
    for name, data in (files or {"model.xml": b"<xml/>", "model.bin": os.urandom(64), "int8.json": b"{}"}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


class Peer:
    """`embedfleet cache serve-peers` on a cache root, on a free loopback port."""

    def __init__(self, root: Path, key_file: Path | None = None) -> None:
        self.root = root
        # free_port() is free when asked; another process on a busy machine may bind it before the server does,
        # which the server reports by exiting (EADDRINUSE): then it starts again on another port
        for _ in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log = root.parent / f"peer-{self.port}.log"
            with open(self.log, "w") as out:
                key = ["--peer-key-file", str(key_file)] if key_file else []
                self.proc = spawn([*CLI, "serve-peers", "--cache-root", str(root), "--host", "127.0.0.1",
                                   "--port", str(self.port), *key], env=child_env(), stdout=out,
                                  stderr=subprocess.STDOUT)
            if self._started():
                return
            if self.proc.poll() is None or "address already in use" not in self.log.read_text():
                break
        raise AssertionError(f"peer server did not start: {self.log.read_text()}")

    def _started(self) -> bool:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                time.sleep(0.1)
        return False

    def served(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if "serving " in line]


