"""Pull one model into a cache directory: fetch into a temp dir, verify, record, then publish by rename.

Layout: ``<cache-dir>/<entry>/`` holds the model's files, where ``<entry>`` is ``sha256-<hex>`` in a
pod's own cache and ``<namespace>_sha256-<hex>`` in the node cache (`naming.cache_entry`). Next to the
files the puller writes ``.manifest`` (the verified, unpacked tree, ``sha256sum`` format, which the
runtime checks before loading) and ``.ready`` (the digest), both *inside the temp dir*, and only then
renames the temp dir into place: the rename is the one atomic step that publishes verified bytes, so
a reader that sees the marker sees a complete entry. The temp dir lives inside ``<cache-dir>`` so the
rename stays on one filesystem.

A directory without the marker is a leftover: an empty one (what the kubelet creates, owned by root,
when a runtime pod's hostPath reaches a node before the weights) is replaced by the rename itself
(rename(2) may replace an empty directory; only write permission on the cache directory is needed, so
a non-root puller replaces a root-owned one), anything else is removed first.
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

from .digest import ENTRY_MANIFEST, READY_MARKER, manifest_lines, parse_digest, render_manifest
from .sources import FetchError, UnsupportedSource, fetch

log = logging.getLogger(__name__)


def entry_path(cache_dir: Path, digest: str, entry: str | None = None) -> Path:
    """Where a digest lives in a cache: ``entry`` when given (the node cache's per-tenant name), else
    ``sha256-<hex>`` (a pod's own cache)."""
    return cache_dir / (entry or naming.cache_subdir(digest))


def is_ready(cache_dir: Path, digest: str, entry: str | None = None) -> bool:
    return (entry_path(cache_dir, digest, entry) / READY_MARKER).is_file()


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


def _clear_leftover(final: Path) -> None:
    """Remove an unverified leftover, except an empty directory, which the publishing rename replaces
    (and which a runtime pod may have mounted: replacing keeps the path a directory throughout)."""
    if final.is_symlink() or final.is_file():
        final.unlink()
    elif final.is_dir() and any(final.iterdir()):
        log.warning("removing unverified leftover %s", final)
        shutil.rmtree(final)


def pull(
    source: str,
    digest: str,
    cache_dir: Path,
    retries: int = 3,
    backoff_s: float = 1.0,
    timeout_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
    entry: str | None = None,
    max_bytes: int | None = None,
) -> PullResult:
    """Make ``entry_path(cache_dir, digest, entry)`` hold verified weights; idempotent once ready.

    ``retries`` counts attempts after the first; waits double from ``backoff_s`` (capped at 60 s).
    ``max_bytes`` bounds what one attempt downloads (a larger source fails permanently).
    """
    expected_hex = parse_digest(digest)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = entry_path(cache_dir, digest, entry)
    if (final / READY_MARKER).is_file():
        return PullResult(final, 0, "already cached")
    _clear_leftover(final)

    attempts = 0
    last_error = ""
    while attempts <= retries:
        attempts += 1
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{expected_hex[:12]}-", dir=cache_dir))
        try:
            fetched = fetch(source, tmp, expected_hex, timeout=timeout_s, max_bytes=max_bytes)
            (tmp / ENTRY_MANIFEST).write_bytes(render_manifest(manifest_lines(tmp)))
            (tmp / READY_MARKER).write_text(f"sha256:{expected_hex}\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the runtime may run as another user
            try:
                tmp.rename(final)
            except OSError:
                # Another puller won the race: its complete entry (marker included) is what counts.
                if (final / READY_MARKER).is_file():
                    return PullResult(final, attempts, "already cached (concurrent pull)")
                raise
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


def link_node_entry(node_entry: Path, digest: str, cache_dir: Path) -> Path | None:
    """Use the node cache's copy when it is ready for this digest: ``<cache-dir>/sha256-<hex>`` becomes a
    symlink to it and is returned; None when the node does not hold it (the caller pulls instead).

    Only the marker is checked here, which costs nothing; the runtime verifies every file against the
    manifest before loading (`digest.verify_entry`), so a damaged node entry stops the pod loudly.
    """
    expected = f"sha256:{parse_digest(digest)}"
    marker = node_entry / READY_MARKER
    try:
        named = marker.read_text().strip()
    except OSError:
        return None
    if named != expected:
        log.warning("node cache %s holds %r, not %s; pulling into the pod instead", node_entry, named, expected)
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    link = entry_path(cache_dir, digest)
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)
    link.symlink_to(node_entry, target_is_directory=True)
    return link
