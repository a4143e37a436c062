"""Shared fixtures: real server processes on loopback, started from this checkout."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests import parallel
from tests.procs import RuntimeServer, start_runtime

# OpenVINO's usage telemetry, blocked in every test process the way the int8 engine blocks it in the runtime
# (engines/int8_cpu.py no_telemetry): `import openvino` loads it, so a test module's importorskip("openvino")
# at collection would load it before the engine can block it, and nncf.quantize would then report usage by
# forking a sender from a thread of a process full of torch's and OpenVINO's threads (a child that can abort).
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.kube.fixtures"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Before any test computes with torch in this process: make bf16 on CPU safe the way the runtime
    does (engines/cpu_isa.py). On a CPU that faults on AMX this caps oneDNN's ISA, which it reads once,
    at its first kernel; without it an in-process bf16 test kills pytest by SIGILL, with no summary."""
    if importlib.util.find_spec("torch") and importlib.util.find_spec("embedfleet.runtime"):
        from embedfleet.runtime.engines.cpu_isa import ensure_cpu_bf16

        ensure_cpu_bf16()


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

    def start(*flags: str, env: dict[str, str | None] | None = None, wait_ready: bool = True) -> RuntimeServer:
        srv = start_runtime(*flags, env=env, wait_ready=wait_ready)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def cpu_bf16() -> None:
    """For tests that run bf16 on CPU in this process: skipped where bf16 crashes this CPU even with
    oneDNN's ISA capped (the runtime serves float32 there)."""
    from embedfleet.runtime.engines.cpu_isa import ensure_cpu_bf16

    decision = ensure_cpu_bf16()
    if not decision.bf16:
        pytest.skip(decision.message)


_PHASES: list[tuple[str, float, float]] = []  # (nodeid, wall s, CPU s) of every test phase, for the summary


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Each phase's report carries its CPU seconds (from `pytest_runtest_protocol`'s marks) to the
    controller, so the summary can name the files that cost the most CPU, whichever worker ran them."""
    outcome = yield
    report = outcome.get_result()
    now = parallel.cpu_seconds()
    report.user_properties.append(("cpu_s", now - getattr(item, "_cpu_mark", now)))
    item._cpu_mark = now  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    item._cpu_mark = parallel.cpu_seconds()  # type: ignore[attr-defined]
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    cpu = dict(report.user_properties).get("cpu_s", 0.0)
    _PHASES.append((report.nodeid, report.duration, float(cpu)))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if parallel.under_xdist() or not _PHASES:
        return  # a worker's summary is not shown; the controller has every worker's reports
    terminalreporter.section("slowest files")
    for line in parallel.summary_lines(parallel.slowest_files(_PHASES), sum(c for _, _, c in _PHASES)):
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if parallel.under_xdist():
        parallel.longest_first(items)


if importlib.util.find_spec("xdist"):
    def pytest_xdist_make_scheduler(config: pytest.Config, log):
        return parallel.make_scheduler(config, log)
