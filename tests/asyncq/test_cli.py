"""The `embedfleet worker` and `embedfleet jobs` commands refuse to run half-configured."""

from __future__ import annotations

import subprocess
import sys

from tests.asyncq.procs import jobs_cli
from tests.procs import ROOT, child_env


def test_worker_needs_redis() -> None:
    done = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "worker"], capture_output=True, text=True,
                          env=child_env({"EMBEDFLEET_REDIS_URL": ""}), cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "--redis-url" in done.stderr


def test_worker_names_a_bad_setting() -> None:
    done = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "worker", "--redis-url", "redis://x",
                           "--async-worker-concurrency", "0"], capture_output=True, text=True, env=child_env(),
                          cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "async_worker_concurrency" in done.stderr


def test_replay_needs_a_choice(redis_server) -> None:
    done = jobs_cli(redis_server.url, "dlq", "replay")
    assert done.returncode == 2 and "--all" in done.stderr
    unknown = jobs_cli(redis_server.url, "dlq", "replay", "feedbeef")
    assert unknown.returncode == 1 and "feedbeef" in unknown.stderr
    assert jobs_cli(redis_server.url, "show", "feedbeef").returncode == 1
