"""How the suite runs on three workers over two cores (README's test command: ``pytest -n 3``, pytest-xdist).

Part of the suite's time is waiting (images imported into containerd, controllers driven through their
real periods, time-outs run out): with a worker per core, a core idles while its worker waits, so a
third worker fills those gaps. The rules that keep that safe:

- **One file, one worker** (xdist's file scheduling): a module's fixtures (a fleet of clusters, a built
  model) are built once, and the tests of one file never race each other. Each worker has its own session
  control plane and its own pod range (tests/kube/netns.py: a /24 per process). The real-node tier's
  files are one scope (`SHARED_SCOPES`): they share one machine-wide node (its bridge, containerd and
  kubelets), so they run on one worker, one after the other.
- **The longest files first**: a file that takes many minutes, started last, would leave one worker
  running it alone at the end. ``LONGEST`` lists them, longest first, from CI's ``--durations``; every
  other file keeps collection order after them. Scopes are handed out in this order (xdist's reordering by
  test count is turned off).

At the end of a run the terminal summary lists the files that took longest (`slowest_files`): wall seconds
(setup, call and teardown of their tests) and CPU seconds (the worker's own, plus the processes it started
and reaped meanwhile: servers, controllers, `helm`). CI keeps only its log, and this is what decides
``LONGEST`` and where the suite's time is worth cutting.
"""

from __future__ import annotations

import os
import resource
from collections import defaultdict
from collections.abc import Iterable

import pytest

#: Files that take minutes, longest first (CONTRIBUTING.md, "The slowest tests").
LONGEST = (
    "tests/realnode/test_user_path.py",
    "tests/realnode/test_two_nodes.py",
    "tests/operator/test_operator_real.py",
    "tests/runtime/test_int8_scoring_gate.py",
    "tests/chart/test_chart_install.py",
    "tests/hub/test_fleet_real.py",
    "tests/gateway/test_wake_twice.py",
    "tests/chart/test_chart_operator.py",
    "tests/operator/test_rollout_real.py",
    "tests/runtime/test_lifecycle.py",
    "tests/operator/test_cache_agent.py",
    "tests/runtime/test_probe.py",
    "tests/hub/test_spill_real.py",
    "tests/gpu/test_fp8_server.py",
    "tests/runtime/test_int8_scoring.py",
    "tests/hub/test_hub_watch_real.py",
    "tests/runtime/test_int8_cpu.py",
    "tests/fuzz/test_fuzz_runtime.py",
    "tests/operator/test_operator_faults.py",
    "tests/abuse/test_timeouts.py",
)


#: Folders whose files must run on one worker, in order (they share something machine-wide).
SHARED_SCOPES = ("tests/realnode/",)


def scope_of(nodeid: str) -> str:
    """The unit handed to one worker: a file, or the whole folder for SHARED_SCOPES."""
    path = nodeid.split("::", 1)[0]
    return next((folder for folder in SHARED_SCOPES if path.startswith(folder)), path)


def under_xdist() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def longest_first(items: list[pytest.Item]) -> None:
    """Stable reorder in place: LONGEST's files first, in its order; the rest as collected."""
    rank = {path: i for i, path in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False  # hand out files in collection order (LONGEST first)
    return FileScheduling(config, log)


def cpu_seconds() -> float:
    """CPU time of this process and of the children it has reaped, user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def slowest_files(reports: Iterable[tuple[str, float, float]], top: int = 25) -> list[tuple[str, float, float]]:
    """(nodeid, wall s, CPU s) per test phase -> per file (path, wall s, CPU s), most wall time first."""
    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    for nodeid, seconds, cpu_s in reports:
        path = nodeid.split("::", 1)[0]
        wall[path] += seconds
        cpu[path] += cpu_s
    return sorted(((p, wall[p], cpu[p]) for p in wall), key=lambda row: (-row[1], row[0]))[:top]


def summary_lines(rows: list[tuple[str, float, float]], total_cpu: float) -> list[str]:
    lines = [f"{wall:8.1f} {cpu:8.1f}  {path}" for path, wall, cpu in rows]
    return ["    wall      CPU  file (seconds; CPU: the worker and the processes it reaped)", *lines,
            f"CPU seconds of all files: {total_cpu:.0f}"]
