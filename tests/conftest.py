"""Shared fixtures: real server processes on loopback, started from this checkout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.procs import RuntimeServer, start_runtime

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def server() -> RuntimeServer:
    """One default server (embedded all-MiniLM-L6-v2) shared by tests that only read from it."""
    srv = start_runtime()
    yield srv
    srv.stop()


@pytest.fixture
def runtime_factory():
    """Start servers with custom flags; all are stopped at the end of the test."""
    started: list[RuntimeServer] = []

    def start(*flags: str, env: dict[str, str] | None = None, wait_ready: bool = True) -> RuntimeServer:
        srv = start_runtime(*flags, env=env, wait_ready=wait_ready)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
