"""Servers for the fuzz tests: a fresh runtime, a runtime just out of a load storm, a gateway over one."""

from __future__ import annotations

import pytest

from tests.fuzz.storm import StormReport, storm
from tests.gateway.conftest import MODEL, GatewayServer, start_gateway
from tests.procs import RuntimeServer, start_runtime


@pytest.fixture(scope="module")
def fresh_runtime() -> RuntimeServer:
    """A runtime on the embedded default model that nothing else has sent work to."""
    srv = start_runtime()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stormed_runtime() -> tuple[RuntimeServer, StormReport]:
    """A runtime right after 20 s of 96 concurrent clients (1-, 8- and 32-input /v1/embeddings, one
    request in eight abandoned midway), and what the storm saw."""
    srv = start_runtime()
    report = storm(srv.url, clients=96, seconds=20, seed=1)
    yield srv, report
    srv.stop()


@pytest.fixture(scope="module")
def gateway() -> GatewayServer:
    """`embedfleet gateway` in front of a runtime serving the default model."""
    runtime = start_runtime()
    gw = start_gateway("--upstream", f"{MODEL}={runtime.url}")
    yield gw
    gw.stop()
    runtime.stop()
