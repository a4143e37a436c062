"""Gateway processes and stand-in runtimes, started as a user would start them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.procs import ROOT, RuntimeServer, child_env, free_port, spawn

STUB = Path(__file__).with_name("stub_runtime.py")
MODEL = "all-MiniLM-L6-v2"  # the runtime's embedded default model, as it serves it


def _logged(prefix: str, cmd: list[str]) -> tuple[subprocess.Popen, Path]:
    log_file = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)
    proc = spawn(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    return proc, Path(log_file.name)


@dataclass
class GatewayServer(RuntimeServer):
    def load(self) -> dict[str, dict]:
        """/gateway/load's deployments."""
        return httpx.get(f"{self.url}/gateway/load", timeout=10).json()["deployments"]

    def count(self, name: str, **labels: str) -> float:
        """A metric's value, 0 while it has no sample yet."""
        try:
            return self.metric(name, **labels)
        except KeyError:
            return 0.0


@dataclass
class StubRuntime(RuntimeServer):
    def control(self, **settings) -> None:
        httpx.post(f"{self.url}/_control", json=settings, timeout=10).raise_for_status()

    def received(self) -> list[dict]:
        return httpx.get(f"{self.url}/_log", timeout=10).json()


def start_gateway(*flags: str) -> GatewayServer:
    port = free_port()
    proc, log = _logged("embedfleet-gateway-", [sys.executable, "-m", "embedfleet.runtime.cli", "gateway",
                                                 "--host", "127.0.0.1", "--port", str(port), *flags])
    srv = GatewayServer(proc, port, log)
    srv.wait_ready(timeout=60)
    return srv


def start_stub(*flags: str, port: int | None = None) -> StubRuntime:
    port = port or free_port()
    proc, log = _logged("embedfleet-stub-", [sys.executable, str(STUB), "--port", str(port), *flags])
    srv = StubRuntime(proc, port, log)
    srv.wait_ready(timeout=60)
    return srv


def _factory(start: Callable):
    started: list[RuntimeServer] = []

    def make(*args, **kwargs):
        srv = start(*args, **kwargs)
        started.append(srv)
        return srv

    return make, started


@pytest.fixture
def gateway_factory():
    make, started = _factory(start_gateway)
    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def stub_factory():
    make, started = _factory(start_stub)
    yield make
    for srv in started:
        srv.stop()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


async def until(check: Callable[[], bool], what: str, within: float = 60) -> None:
    """`wait_for` inside a scenario that has requests in flight on this event loop."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.02)
