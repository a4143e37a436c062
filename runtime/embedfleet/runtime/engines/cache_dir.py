"""Where built engines (TensorRT-LLM plans, int8 OpenVINO builds) are kept, and how one build is shared: one
rule for every engine that builds something from the weights at start-up."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def default_engine_cache_dir(model_dir: Path) -> Path:
    """`engines/` beside the model (the node-local cache root), else the user's cache.

    The operator mounts the weight cache read-only into runtime pods, so the fallback is what a
    pod uses unless the cache's pre-pull built the engine already.
    """
    beside = model_dir.resolve().parent / "engines"
    if _writable(beside) or (beside.is_dir() and any(beside.iterdir())):
        return beside
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "embedfleet" / "engines"


def _writable(path: Path) -> bool:
    probe = path if path.exists() else path.parent
    return probe.is_dir() and os.access(probe, os.W_OK)


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Hold the exclusive lock on building `path` (a `.<name>.lock` file beside it) across processes.

    Pods of one deployment start together and share the node's cache folder: without it each would
    quantise or compile the same model at once, every one paying minutes of CPU and all but the last
    one's work thrown away. The first to come builds; the others wait here, then find the finished build
    (callers check again under the lock) and load it. `flock` holds between processes and containers on
    one node that mount the same folder; the lock ends with its holder's process, so a pod killed
    mid-build never blocks the next one. Over a network file system it can be advisory only, and then
    the atomic rename of each build still keeps readers from ever seeing half of one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            started = time.monotonic()
            log.info("another process is building %s; waiting for it", path)
            fcntl.flock(fh, fcntl.LOCK_EX)
            log.info("waited %.1fs for the build of %s", time.monotonic() - started, path)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
