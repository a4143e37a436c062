"""Pull one model into the node-local cache: fetch into a temp dir, verify, rename, then mark ready.

Layout: ``<cache-dir>/sha256-<hex>/`` holds the model's files; ``<cache-dir>/sha256-<hex>/.ready`` is
written last, only after the digest matched, so a reader that sees the marker sees verified bytes. The
temp dir lives inside ``<cache-dir>`` so the rename is atomic (same filesystem). A directory without the
marker is a leftover from a crash and is replaced.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from embedfleet.operator.crd import naming

from .digest import READY_MARKER, parse_digest
from .sources import FetchError, UnsupportedSource, fetch

log = logging.getLogger(__name__)


def entry_path(cache_dir: Path, digest: str) -> Path:
    """Where a digest lives in the cache (the runtime mounts this path read-only)."""
    return cache_dir / naming.cache_subdir(digest)


def is_ready(cache_dir: Path, digest: str) -> bool:
    return (entry_path(cache_dir, digest) / READY_MARKER).is_file()


@dataclass(frozen=True)
class PullResult:
    path: Path
    attempts: int
    fetched: str  # what was fetched, or "already cached"


class PullFailed(Exception):
    def __init__(self, message: str, attempts: int, permanent: bool) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.permanent = permanent


def pull(
    source: str,
    digest: str,
    cache_dir: Path,
    retries: int = 3,
    backoff_s: float = 1.0,
    timeout_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> PullResult:
    """Make ``entry_path(cache_dir, digest)`` hold verified weights; idempotent once ready.

    ``retries`` counts attempts after the first; waits double from ``backoff_s`` (capped at 60 s).
    """
    expected_hex = parse_digest(digest)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = entry_path(cache_dir, digest)
    if (final / READY_MARKER).is_file():
        return PullResult(final, 0, "already cached")
    if final.exists():
        log.warning("removing unverified leftover %s", final)
        shutil.rmtree(final)

    attempts = 0
    last_error = ""
    while attempts <= retries:
        attempts += 1
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{expected_hex[:12]}-", dir=cache_dir))
        try:
            fetched = fetch(source, tmp, expected_hex, timeout=timeout_s)
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the runtime may run as another user
            try:
                tmp.rename(final)
            except OSError:
                # Another puller won the race; its result counts only if it got as far as the marker.
                if (final / READY_MARKER).is_file():
                    return PullResult(final, attempts, "already cached (concurrent pull)")
                raise
            (final / READY_MARKER).write_text(f"sha256:{expected_hex}\n")
            log.info("cached %s as %s after %d attempt(s)", fetched, final, attempts)
            return PullResult(final, attempts, fetched)
        except UnsupportedSource as exc:
            raise PullFailed(str(exc), attempts, permanent=True) from exc
        except (FetchError, OSError) as exc:
            last_error = str(exc)
            log.warning("attempt %d/%d failed: %s", attempts, retries + 1, exc)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        if attempts <= retries:
            sleep(min(backoff_s * 2 ** (attempts - 1), 60.0))
    raise PullFailed(f"gave up after {attempts} attempt(s): {last_error}", attempts, permanent=False)
