"""One int8 build per node: replicas that start together on one cache folder build once (engines/cache_dir.py
build_lock). Real processes (the lock is between pods' processes), the real int8 start-up path
(`build_int8_engine`) with the quantisation itself replaced by a slow fake that counts its calls."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path

import pytest

# found, not imported: importing openvino here would load its telemetry before the engine can block it
pytestmark = pytest.mark.skipif(not (find_spec("openvino") and find_spec("nncf")),
                                reason="needs openvino and nncf (the runtime extra)")


def _start(cache_root: str, log: str, build_seconds: float, done) -> None:
    """A replica's start-up: int8 for the embedded default on `cache_root`, with a fake build that appends
    its pid to `log` and takes `build_seconds`; reports what it got through `done`."""
    from embedfleet.runtime.engines import int8_cpu
    from embedfleet.runtime.models.spec import load_spec
    from embedfleet.runtime.settings import default_model_dir

    def fake_build(_fp32, _spec, key, path: Path, _calibration, _threads) -> dict:
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(build_seconds)
        tmp = path.parent / f".build-{os.getpid()}"
        tmp.mkdir(parents=True)
        (tmp / "model.xml").write_text("<net/>")
        manifest = {"key": asdict(key), "min_cosine": 0.5, "mean_cosine": 0.9, "worst_input": 3, "finite": True,
                    "inputs": 10, "seconds": build_seconds}
        (tmp / int8_cpu.MANIFEST).write_text(json.dumps(manifest))
        tmp.rename(path)
        return manifest

    int8_cpu._build = fake_build
    int8_cpu.TorchEngine = lambda *a, **k: None  # the float32 reference the fake never reads
    try:
        int8_cpu.build_int8_engine(load_spec(default_model_dir()), num_threads=1, cache_root=Path(cache_root))
        done.put("served")
    except int8_cpu.Int8Rejected as exc:  # the fake build's gate figures refuse: the verdict is what we compare
        done.put(str(exc).split(";")[0])


def _replicas(n: int, cache_root: Path, log: Path, build_seconds: float):
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    procs = [ctx.Process(target=_start, args=(str(cache_root), str(log), build_seconds, done)) for _ in range(n)]
    for p in procs:
        p.start()
    return procs, done


def test_replicas_starting_together_build_once(tmp_path):
    log = tmp_path / "builds.log"
    procs, done = _replicas(3, tmp_path / "cache", log, build_seconds=2.0)
    verdicts = [done.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(log.read_text().split()) == 1  # one quantisation for three replicas
    assert len(set(verdicts)) == 1 and "int8 refused for embed: min cosine 0.500000" in verdicts[0]


def test_a_builder_killed_midway_does_not_block_the_next(tmp_path):
    """The lock dies with its holder: a pod killed mid-build leaves no lock and no half build behind."""
    log = tmp_path / "builds.log"
    (first,), _ = _replicas(1, tmp_path / "cache", log, build_seconds=60.0)
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)
    first.join(30)
    procs, done = _replicas(1, tmp_path / "cache", log, build_seconds=0.5)
    assert "min cosine 0.500000" in done.get(timeout=120)
    procs[0].join(30)
    assert len(log.read_text().split()) == 2  # the second replica built (the first never finished)
