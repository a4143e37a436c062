"""Copy engine builds from another node's agent (`peer_server`'s ``/v1/engines`` routes), verifying every byte.

A build has no digest of its own to prove (a runtime made it from the weights), so the peer's listing is
trusted as far as its signature: signed with the release's peer key for this request (`peer_auth`), it
comes from another agent, for the same tenant's folder and the same weights. What is checked then is
transit and shape: each file arrives with exactly the
size and sha256 the listing gives, paths stay inside the build (`digest.safe_relpath`), the builds'
names are the layout's (`engines.ACCELERATOR`, `engines.PART`), and the whole copy stays under
``max_bytes``. Each build is fetched into a staging folder in the agent's own root (no tenant pod mounts
it), then published by one rename into the tenant's folder, under the engine's build lock (taken without
waiting: a runtime building that key on this node right now wins, and the copy is skipped). The tenant's
folder is written by the tenant's pods, so it is walked by directory descriptors without following a link
(`safefs`): a link or a special file on the way means no copy, never a write elsewhere. `.source.json`
inside says where it came from.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

import httpx

from . import safefs
from .digest import DigestError, safe_relpath
from .engines import ACCELERATOR, PART, SOURCE_RECORD, Build
from .peer_auth import PeerKey
from .peer_auth import client as peer_client
from .peer_fetch import PeerFailed, download_verified, get_json
from .peers import TokenBucket

log = logging.getLogger(__name__)

#: Staging folders in the agent's root (removed at the next pass when a crash leaves one; see agent.py).
TMP_PREFIX = ".tmp-"


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


def _lock_free(group_fd: int, name: str) -> int | None:
    """The build lock of ``name`` in the group folder ``group_fd`` when nobody holds it (a descriptor: closing
    it releases), else None. Same file as the runtime's `build_lock`: ``.<name>.lock`` beside the build,
    opened without following a link and never truncated (the folder is the tenant's: the name may be a link
    to another tenant's weights, or a FIFO); UnsafePath when it is not a regular file."""
    fd = safefs.open_lock(f".{name}.lock", group_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def copy_build(client: httpx.Client, base: str, entry: str, listed: Listed, entry_dir: Path,
               bucket: TokenBucket | None) -> bool:
    """Publish one listed build into ``entry_dir`` (see the module docstring); False when it was there
    already, a runtime is building it, or the tenant's folder holds a link or a special file on the way;
    PeerFailed when the peer's bytes do not match.

    The tenant's folder is hostile input: its components are opened by descriptor without following links,
    and nothing is written in it but one rename. The files are fetched into a staging folder in the agent's
    own root (``entry_dir``'s parent, which no tenant pod mounts), then renamed into the group folder."""
    build = listed.build
    root = entry_dir.parent
    root_fd = safefs.open_dir(root)
    try:
        try:
            entry_fd = safefs.open_dir(entry_dir.name, root_fd)
            try:
                group_fd = safefs.make_dirs(entry_fd, [build.accelerator, build.group])
            finally:
                os.close(entry_fd)
        except safefs.UnsafePath as exc:
            log.warning("not copying %s/%s: the folder holds a link or a special file (%s)", entry, build.rel, exc)
            return False
        try:
            return _copy_into(client, base, entry, listed, root, root_fd, group_fd, bucket)
        finally:
            os.close(group_fd)
    finally:
        os.close(root_fd)


def _copy_into(client: httpx.Client, base: str, entry: str, listed: Listed, root: Path, root_fd: int,
               group_fd: int, bucket: TokenBucket | None) -> bool:
    build = listed.build
    try:
        lock = _lock_free(group_fd, build.name)
    except safefs.UnsafePath as exc:
        log.warning("not copying %s/%s: its build lock is not a plain file (%s)", entry, build.rel, exc)
        return False
    if lock is None:
        return False
    try:
        try:
            os.stat(build.name, dir_fd=group_fd, follow_symlinks=False)
            return False
        except FileNotFoundError:
            pass
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}engine-", dir=root))
        try:
            for rel, size, sha in listed.files:
                url = f"{base}/v1/engines/{entry}/{build.accelerator}/files/{build.group}/{build.name}/{quote(rel)}"
                download_verified(client, url, tmp / rel, sha, size, bucket)
            record = {"source": "peer", "from": base, "seconds": round(time.monotonic() - started, 3),
                      "bytes": listed.size, "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
            (tmp / SOURCE_RECORD).write_text(json.dumps(record))
            tmp.chmod(0o755)
            os.rename(tmp.name, build.name, src_dir_fd=root_fd, dst_dir_fd=group_fd)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True
    finally:
        os.close(lock)


def fetch_builds(base: str, entry: str, accelerator: str, entry_dir: Path, have: set[Build],
                 timeout: float = 60.0, bucket: TokenBucket | None = None,
                 max_bytes: int | None = None, key: PeerKey | None = None) -> list[Build]:
    """Copy from the agent at ``base`` every build of ``accelerator`` it lists that ``have`` lacks; returns
    the builds published here. Nothing is fetched when the missing builds together pass ``max_bytes``."""
    if not ACCELERATOR.match(accelerator):
        raise ValueError(f"not an accelerator name: {accelerator!r}")
    with peer_client(timeout, key) as client:
        missing = [item for item in listing(client, base, entry, accelerator) if item.build not in have]
        total = sum(item.size for item in missing)
        if max_bytes is not None and total > max_bytes:
            raise PeerFailed(f"{base}: the builds of {entry} for {accelerator} hold {total} bytes, more than "
                             f"the limit of {max_bytes}")
        return [item.build for item in missing
                if copy_build(client, base, entry, item, entry_dir, bucket)]
