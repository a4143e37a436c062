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

Single flight: a pull holds an exclusive ``flock`` on ``<cache-dir>/.lock-<entry>`` from its first look
at the entry to its publication, so concurrent pulls of one entry on one node (agent passes, a restarted
agent beside its predecessor, init containers sharing a cache) download it once; the others wait, then
find it ready. The lock ends with its holder's process, so a killed puller never blocks the next.

With ``peers`` (base URLs of other nodes' agents, best first: `peers.choose_peers`), each is asked once
for ``peer_entry`` before the origin (`peer_fetch`); a peer that fails in any way is skipped. Beside
``.ready`` the puller writes ``.source.json``: ``{"source": "peer"|"origin", "from": URL, "seconds",
"bytes", "at"}``, how this copy came to be (cold-start reporting reads it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from embedfleet.operator.crd import naming

from .digest import ENTRY_MANIFEST, READY_MARKER, SOURCE_RECORD, manifest_lines, parse_digest, render_manifest
from .peer_auth import PeerKey
from .peer_fetch import PeerFailed, fetch_from_peer
from .peers import TokenBucket, fetch_plan
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
    source: str = "cache"  # "peer", "origin", or "cache" (it was there already)
    seconds: float = 0.0


@contextlib.contextmanager
def entry_lock(cache_dir: Path, name: str) -> Iterator[None]:
    """Hold the exclusive lock on pulling ``name`` into ``cache_dir`` (see the module docstring)."""
    # opened without following a link and never truncated: whatever the name holds, no other file changes
    fd = os.open(cache_dir / f".lock-{name}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 0o644)
    with open(fd, "r+b", buffering=0) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            started = time.monotonic()
            log.info("another process is pulling %s; waiting for it", name)
            fcntl.flock(fh, fcntl.LOCK_EX)
            log.info("waited %.1fs for the pull of %s", time.monotonic() - started, name)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path, expected_hex: str, record: dict[str, object],
             verified: list[tuple[str, str]] | None = None) -> bool:
    """Record, mark and rename ``tmp`` into place; False when a concurrent puller published first.
    ``verified``: the (sha256, path) of every file in ``tmp``, already checked while it arrived."""
    (tmp / ENTRY_MANIFEST).write_bytes(render_manifest(verified if verified is not None else manifest_lines(tmp)))
    (tmp / SOURCE_RECORD).write_text(json.dumps(record) + "\n")
    (tmp / READY_MARKER).write_text(f"sha256:{expected_hex}\n")
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the runtime may run as another user
    try:
        tmp.rename(final)
    except OSError:
        # Another puller won the race: its complete entry (marker included) is what counts.
        if (final / READY_MARKER).is_file():
            return False
        raise
    return True


def _record(source: str, where: str, seconds: float, size: int) -> dict[str, object]:
    return {"source": source, "from": where, "seconds": round(seconds, 3), "bytes": size,
            "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


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
    peers: Sequence[str] = (),
    peer_entry: str | None = None,
    bucket: TokenBucket | None = None,
    peer_key: PeerKey | None = None,
) -> PullResult:
    """Make ``entry_path(cache_dir, digest, entry)`` hold verified weights; idempotent once ready.

    ``peers`` are asked for ``peer_entry`` (default: ``entry``) once each, in order, through ``bucket``
    (signing with ``peer_key``, `peer_auth`);
    then the origin: ``retries`` counts its attempts after the first; waits double from ``backoff_s``
    (capped at 60 s). ``max_bytes`` bounds what one attempt downloads (a larger source fails permanently).
    """
    expected_hex = parse_digest(digest)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = entry_path(cache_dir, digest, entry)
    with entry_lock(cache_dir, final.name):
        if (final / READY_MARKER).is_file():
            return PullResult(final, 0, "already cached")
        _clear_leftover(final)
        asked = peer_entry or entry
        if peers and asked:
            for step in fetch_plan(peers, source)[:-1]:
                started = time.monotonic()
                tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{expected_hex[:12]}-", dir=cache_dir))
                try:
                    fetched, size, verified = fetch_from_peer(step.url, asked, expected_hex, tmp, timeout=timeout_s,
                                                              bucket=bucket, max_bytes=max_bytes, key=peer_key)
                    seconds = time.monotonic() - started
                    if not _publish(tmp, final, expected_hex, _record("peer", step.url, seconds, size), verified):
                        return PullResult(final, 0, "already cached (concurrent pull)")
                    log.info("cached %s as %s from peer %s in %.2fs", asked, final, step.url, seconds)
                    return PullResult(final, 0, fetched, "peer", seconds)
                except (PeerFailed, OSError) as exc:
                    log.warning("peer %s: %s; trying the next source", step.url, exc)
                finally:
                    if tmp.exists():
                        shutil.rmtree(tmp, ignore_errors=True)
        return _pull_origin(source, expected_hex, cache_dir, final, retries, backoff_s, timeout_s, sleep, max_bytes)


def _pull_origin(source: str, expected_hex: str, cache_dir: Path, final: Path, retries: int, backoff_s: float,
                 timeout_s: float, sleep: Callable[[float], None], max_bytes: int | None) -> PullResult:
    attempts = 0
    last_error = ""
    while attempts <= retries:
        attempts += 1
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{expected_hex[:12]}-", dir=cache_dir))
        try:
            fetched = fetch(source, tmp, expected_hex, timeout=timeout_s, max_bytes=max_bytes)
            seconds = time.monotonic() - started
            if not _publish(tmp, final, expected_hex, _record("origin", source, seconds, _tree_bytes(tmp))):
                return PullResult(final, attempts, "already cached (concurrent pull)")
            log.info("cached %s as %s after %d attempt(s)", fetched, final, attempts)
            return PullResult(final, attempts, fetched, "origin", seconds)
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
