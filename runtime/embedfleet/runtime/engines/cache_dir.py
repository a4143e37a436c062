"""Where built engines (TensorRT-LLM plans, int8 OpenVINO builds) are kept: one rule for every engine that
builds something from the weights at start-up."""

from __future__ import annotations

import os
from pathlib import Path


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
