"""Fixtures: real stub server processes on loopback, reset before each test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.procs import free_port, spawn, stop_process

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Stub:
    """Handle on one stub server process: its URL, fault control and request log."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn(
            [sys.executable, os.path.join(HERE, "stub_server.py"), "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.url + "/health", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"stub server did not start: {err}") from None
                time.sleep(0.05)

    def control(self, **body: Any) -> None:
        httpx.post(self.url + "/_control", json=body, timeout=5).raise_for_status()

    def fault(self, kind: str, times: int = 1, **extra: Any) -> None:
        self.control(faults=[{"kind": kind, "times": times, **extra}])

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/_stats", timeout=5).json()

    @property
    def count(self) -> int:
        return int(self.stats()["count"])

    def stop(self) -> None:
        stop_process(self.proc, timeout=5)


@pytest.fixture(scope="session")
def _stubs() -> Iterator[list[Stub]]:
    stubs = [Stub(), Stub()]
    yield stubs
    for s in stubs:
        s.stop()


@pytest.fixture
def stub(_stubs: list[Stub]) -> Stub:
    for s in _stubs:
        s.control(reset=True)
    return _stubs[0]


@pytest.fixture
def stub2(_stubs: list[Stub], stub: Stub) -> Stub:
    return _stubs[1]


@pytest.fixture
def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"
