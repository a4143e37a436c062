"""Copy engine builds from another node's agent (`peer_server`'s ``/v1/engines`` routes), verifying every byte.

A build has no digest of its own to prove (a runtime made it from the weights), so the peer's listing
is trusted as far as the agent itself: it is the platform's identity, and it names the same tenant's
folder for the same weights. What is checked is transit and shape: each file arrives with exactly the
size and sha256 the listing gives, paths stay inside the build (`digest.safe_relpath`), the builds'
names are the layout's (`engines.ACCELERATOR`, `engines.PART`), and the whole copy stays under
``max_bytes``. Each build lands as the runtime's own do: into a dot-named folder beside its place, then
one rename, under the engine's build lock (taken without waiting: a runtime building that key on this
node right now wins, and the copy is skipped). `.source.json` inside says where it came from.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

import httpx

from .digest import DigestError, safe_relpath
from .engines import ACCELERATOR, PART, SOURCE_RECORD, Build
from .peer_fetch import PeerFailed, download_verified, get_json
from .peers import TokenBucket

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Listed:
    build: Build
    files: list[tuple[str, int, str]]  # (path, size, sha256)

    @property
    def size(self) -> int:
        return sum(size for _, size, _ in self.files)


def listing(client: httpx.Client, base: str, entry: str, accelerator: str) -> list[Listed]:
    """The peer's complete builds of ``entry`` for ``accelerator``; PeerFailed for anything malformed."""
    url = f"{base}/v1/engines/{entry}/{accelerator}/manifest"
    body = get_json(client, url)
    try:
        out = []
        for item in body["builds"]:
            group, name = str(item["group"]), str(item["name"])
            if not (PART.match(group) and PART.match(name)):
                raise ValueError(f"not a build name: {group!r}/{name!r}")
            files = [(safe_relpath(str(f["path"])), int(f["size"]), str(f["sha256"])) for f in item["files"]]
            if not files or any(size < 0 or len(sha) != 64 for _, size, sha in files):
                raise ValueError("a build with no files, a negative size or a bad sha256")
            if len({rel for rel, _, _ in files}) != len(files):
                raise ValueError("a path listed twice")
            out.append(Listed(Build(accelerator, group, name), files))
    except (ValueError, KeyError, TypeError, DigestError) as exc:
        raise PeerFailed(f"GET {url}: not an engine listing ({type(exc).__name__}: {exc})") from exc
    return out


def _lock_free(group_dir: Path, name: str) -> object | None:
    """The build lock of ``group_dir/name`` when nobody holds it (an open file: closing it releases), else
    None. Same file as the runtime's `build_lock`: ``.<name>.lock`` beside the build."""
    fh = open(group_dir / f".{name}.lock", "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    return fh


def copy_build(client: httpx.Client, base: str, entry: str, listed: Listed, entry_dir: Path,
               bucket: TokenBucket | None) -> bool:
    """Publish one listed build into ``entry_dir`` (see the module docstring); False when it was there
    already or a runtime is building it; PeerFailed when the peer's bytes do not match."""
    build = listed.build
    group_dir = entry_dir / build.accelerator / build.group
    group_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock_free(group_dir, build.name)
    if lock is None:
        return False
    try:
        final = group_dir / build.name
        if final.exists() or final.is_symlink():
            return False
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{build.name}.peer-", dir=group_dir))
        try:
            for rel, size, sha in listed.files:
                url = f"{base}/v1/engines/{entry}/{build.accelerator}/files/{build.group}/{build.name}/{quote(rel)}"
                download_verified(client, url, tmp / rel, sha, size, bucket)
            record = {"source": "peer", "from": base, "seconds": round(time.monotonic() - started, 3),
                      "bytes": listed.size, "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
            (tmp / SOURCE_RECORD).write_text(json.dumps(record))
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True
    finally:
        lock.close()  # type: ignore[attr-defined]


def fetch_builds(base: str, entry: str, accelerator: str, entry_dir: Path, have: set[Build],
                 timeout: float = 60.0, bucket: TokenBucket | None = None,
                 max_bytes: int | None = None) -> list[Build]:
    """Copy from the agent at ``base`` every build of ``accelerator`` it lists that ``have`` lacks; returns
    the builds published here. Nothing is fetched when the missing builds together pass ``max_bytes``."""
    if not ACCELERATOR.match(accelerator):
        raise ValueError(f"not an accelerator name: {accelerator!r}")
    with httpx.Client(timeout=timeout, headers={"accept-encoding": "identity"}) as client:
        missing = [item for item in listing(client, base, entry, accelerator) if item.build not in have]
        total = sum(item.size for item in missing)
        if max_bytes is not None and total > max_bytes:
            raise PeerFailed(f"{base}: the builds of {entry} for {accelerator} hold {total} bytes, more than "
                             f"the limit of {max_bytes}")
        return [item.build for item in missing
                if copy_build(client, base, entry, item, entry_dir, bucket)]
