"""The node agent's part in engine builds: keep each wanted engines folder ready for the runtimes, bounded,
published on the node, and filled from peers of the same accelerator.

For every engines folder this node should keep (`wanted.wanted_engines`: deployments with pre-pull whose
runtime builds an engine), each pass:

1. makes sure ``<root>/<namespace>_engines-sha256-<hex>/`` exists and is the agent's (so, the runtime's:
   both run as uid 10001). Where a runtime pod landed first, the kubelet made it, empty and root-owned:
   it is replaced by one rename, as a weight entry is;
2. with peers on, for each of this node's accelerators (`engines.node_accelerators`: its CPU class, its
   GPU model from the node label) of which it holds no build yet, asks the agents of nodes labelled as
   holding builds of that folder for that accelerator, best first, for their builds
   (`engine_fetch.fetch_builds`; the first peer that answers is enough). A runtime starting on this node
   then finds its build ready and skips minutes of quantising or compiling;
3. keeps the folder under ``max_bytes`` (its runtimes can write into it: the oldest builds go first, with a
   warning), since a hostPath has no size limit of its own;
4. returns the node labels that say which (tenant, model, accelerator) builds are held here
   (`naming.engine_label_key`), for the same merge patch as the weights' labels.

Folders nobody wants any more retire with the weights' retention (the caller's `plan`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from embedfleet.operator.crd import naming

from . import safefs
from .engine_fetch import TMP_PREFIX, fetch_builds
from .engines import list_builds, node_accelerators
from .peer_auth import PeerKey
from .peer_fetch import PeerFailed
from .peers import TokenBucket
from .wanted import ENGINES_NAME, Want

log = logging.getLogger(__name__)


def scan_engines(root: Path) -> dict[str, bool]:
    """Engines folders in the root (all count as ready: what is inside is complete builds or nothing)."""
    return {child.name: True for child in root.iterdir()
            if ENGINES_NAME.match(child.name) and (child.is_dir() or child.is_symlink())}


def ensure_folder(root: Path, name: str) -> Path:
    """``root/name`` as a directory this process owns (mode 0755), replacing an empty one it cannot write
    (the kubelet's) or a symlink; OSError when a non-empty one is in the way."""
    path = root / name
    if path.is_symlink():
        path.unlink()
    if path.is_dir():
        if os.access(path, os.W_OK):
            return path
        if any(path.iterdir()):
            raise OSError(f"{path}: not writable by uid {os.getuid()} and not empty")
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
    tmp.chmod(0o755)
    try:
        tmp.rename(path)  # rename(2) replaces an empty directory; needs write permission on the root only
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def prune(folder: Path, max_bytes: int) -> list[str]:
    """Delete the oldest complete builds until the folder's builds hold at most ``max_bytes``; the builds removed.

    The folder is the tenant's: builds are measured and deleted through directory descriptors, following no
    link (a build whose way holds one is neither counted nor touched)."""
    entry_fd = safefs.open_dir(folder)
    try:
        sized = []
        for build in list_builds(folder):
            try:
                build_fd = safefs.open_dirs(entry_fd, [build.accelerator, build.group, build.name])
                try:
                    sized.append((os.fstat(build_fd).st_mtime, build, safefs.tree_bytes(build_fd)))
                finally:
                    os.close(build_fd)
            except OSError as exc:
                log.warning("engine build %s/%s not measured: %s", folder.name, build.rel, exc)
        total = sum(size for _, _, size in sized)
        removed = []
        for _, build, size in sorted(sized):
            if total <= max_bytes:
                break
            try:
                group_fd = safefs.open_dirs(entry_fd, [build.accelerator, build.group])
                try:
                    safefs.remove_tree(build.name, group_fd)
                finally:
                    os.close(group_fd)
            except OSError as exc:
                log.warning("engine build %s/%s not deleted: %s", folder.name, build.rel, exc)
                continue
            total -= size
            removed.append(build.rel)
        return removed
    finally:
        os.close(entry_fd)


@dataclass
class EngineOutcome:
    labels: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)


#: (label key, digest) -> peer base URLs, best first (the agent's `find_peers`, bound to its node).
FindPeers = Callable[[str, str], list[str]]


def sync_engines(root: Path, wanted: Mapping[str, Want], node_labels: Mapping[str, str], cpu: str,
                 find_peers: FindPeers | None, timeout_s: float = 60.0, bucket: TokenBucket | None = None,
                 max_bytes: int | None = None, peer_key: PeerKey | None = None) -> EngineOutcome:
    """One pass over the wanted engines folders (see the module docstring)."""
    out = EngineOutcome()
    accelerators = node_accelerators(node_labels, cpu)
    for name, want in sorted(wanted.items()):
        try:
            folder = ensure_folder(root, name)
        except OSError as exc:
            out.problems.append(f"engines folder {name}: {exc}")
            log.error("engines folder %s: %s", name, exc)
            continue
        for accelerator in accelerators if find_peers is not None else ():
            have = set(list_builds(folder, accelerator))
            if have:
                continue  # asked only while none is held: a steady node makes no API call for its builds
            label = naming.engine_label_key(want.digest, want.namespace, accelerator)
            for base in find_peers(label, want.digest):
                try:
                    got = fetch_builds(base, name, accelerator, folder, have, timeout=timeout_s, bucket=bucket,
                                       max_bytes=max_bytes, key=peer_key)
                except (PeerFailed, OSError) as exc:
                    log.warning("engine builds of %s for %s from %s failed (next peer): %s", name, accelerator,
                                base, exc)
                    continue
                for build in got:
                    log.info("engine build %s/%s fetched from peer %s", name, build.rel, base)
                    out.fetched.append(f"{name}/{build.rel}")
                break
        if max_bytes:
            for rel in prune(folder, max_bytes):
                log.warning("engine build %s/%s deleted: the folder held more than %d bytes", name, rel, max_bytes)
        for accelerator in sorted({b.accelerator for b in list_builds(folder)}):
            out.labels.append(naming.engine_label_key(want.digest, want.namespace, accelerator))
    return out
