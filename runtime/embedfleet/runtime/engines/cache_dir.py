"""Where built engines (TensorRT-LLM plans, int8 OpenVINO builds) are kept, how one build is shared, and
where the build a runtime loads came from: one rule for every engine that builds something from the weights
at start-up.

Every build lives at ``<engine cache dir>/<accelerator>/<group>/<build>/`` (`engine_root` gives the first two
parts; the layout, and the accelerator names, are embedfleet/operator/cache/engines.py's, shared with the
node agent that copies builds between nodes of one accelerator class)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from embedfleet.operator.cache.engines import ACCELERATOR, PART, SOURCE_RECORD  # stdlib only

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


def engine_root(cache_root: Path | None, model_dir: Path, accelerator: str) -> Path:
    """The folder an engine's builds for `accelerator` go under: ``<cache root>/<accelerator>``, the cache
    root being --engine-cache-dir when set, else `default_engine_cache_dir` of the model. A build made on one
    processor class is only good on that class, so builds of different classes never share a folder."""
    if not ACCELERATOR.match(accelerator):
        raise ValueError(f"not an accelerator name: {accelerator!r}")
    return Path(cache_root or default_engine_cache_dir(model_dir)) / accelerator


def check_part(name: str) -> str:
    """`name` when it can be a group or build folder (engines.PART: no leading dot, no separator), else
    ValueError: what the node agent lists and copies is exactly what passes that rule."""
    if not PART.match(name):
        raise ValueError(f"not a valid engine build folder name: {name!r}")
    return name


#: Where a loaded build came from: ``built`` (this process built it), ``cache`` (a complete build was already
#: in the folder, made on this node), ``peer`` (the node agent copied it from another node of the same class).
BuildSourceName = Literal["built", "cache", "peer"]


@dataclass(frozen=True)
class BuildSource:
    """Where the build an engine loads came from, and its folder. Engines that build something (int8,
    TensorRT-LLM) carry one as ``build_source``; the service hands it to cold_start.ColdStart."""

    source: BuildSourceName
    path: Path
    peer: str | None = None  # for ``peer``: the agent's URL it was fetched from, when the record names one

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "path": str(self.path)}
        if self.peer is not None:
            out["from"] = self.peer
        return out

    def describe(self) -> str:
        if self.source == "built":
            return "built"
        if self.source == "cache":
            return "reused from this node"
        return f"fetched from a peer ({self.peer or 'unknown'})"


def build_source(path: Path, built: bool) -> BuildSource:
    """`built` when this process built `path`; else ``peer`` when the build holds the agent's SOURCE_RECORD
    saying so, else ``cache``. The record is read tolerantly (it only informs a report): one that is missing,
    not JSON or names another source counts as this node's own build."""
    if built:
        return BuildSource("built", path)
    try:
        doc = json.loads((path / SOURCE_RECORD).read_text(encoding="utf-8", errors="replace")[:4096])
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and doc.get("source") == "peer":
        peer = doc.get("from")
        return BuildSource("peer", path, peer[:256] if isinstance(peer, str) and peer else None)
    return BuildSource("cache", path)


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
