"""The process helpers every fixture starts children with: nothing outlives the test run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.procs import ROOT, child_env, spawn, stop_process

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _gone(pid: int, timeout: float = 10) -> bool:
    """True once `pid` has exited (a zombie waiting for a reaper counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_when_its_parent_is_killed():
    """What happens when pytest itself dies (SIGKILL, SIGILL): no teardown runs, the kernel kills."""
    code = f"import time; from tests.procs import spawn; print(spawn({SLEEPER!r}).pid, flush=True); time.sleep(120)"
    parent = spawn([sys.executable, "-c", code], stdout=subprocess.PIPE, env=child_env(), cwd=ROOT)
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child, timeout=0.2)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(child), f"process {child} outlived its parent"
    finally:
        stop_process(parent, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_takes_the_whole_process_group():
    proc = spawn(["sh", "-c", f"{' '.join(SLEEPER[:2])} '{SLEEPER[2]}' & echo $!; wait"], stdout=subprocess.PIPE)
    grandchild = int(proc.stdout.readline())
    assert os.getpgid(grandchild) == proc.pid  # its own group, led by the child
    stop_process(proc, signal.SIGTERM, timeout=1)
    assert proc.returncode is not None and _gone(grandchild)
