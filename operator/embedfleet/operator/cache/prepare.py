"""``embedfleet cache prepare``: hand the node cache root to the agent's uid, once, as root.

The kubelet creates a missing hostPath directory owned by root (mode 0755), and the node agent runs as
uid 10001, so without this step every pull fails with EACCES. It runs in the agent DaemonSet's init
container with uid 0 but only CAP_CHOWN (every other capability dropped), which is why the order below
matters: the mode is set while root still owns the directory (changing the mode of a file one does not
own needs CAP_FOWNER), then ownership moves. Anything inside not owned by the agent (entries left by
the older root-run puller, empty entries the kubelet made) is handed over too, so the agent can replace
or retire it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def parse_owner(text: str) -> tuple[int, int]:
    """``UID:GID`` (numbers only: a name would need the node's /etc/passwd, which the image does not have)."""
    uid, sep, gid = text.partition(":")
    if not sep or not uid.isdigit() or not gid.isdigit():
        raise ValueError(f"--owner must be UID:GID in numbers, got {text!r}")
    return int(uid), int(gid)


def prepare(root: Path, uid: int, gid: int) -> int:
    """mkdir -p, mode 0755, owner uid:gid for the root and everything in it; returns how many paths
    changed owner. Unreadable corners are logged and skipped (the agent replaces what it cannot use)."""
    root.mkdir(parents=True, exist_ok=True)
    st = root.stat()
    if st.st_mode & 0o7777 != 0o755:
        os.chmod(root, 0o755)
    changed = 0

    def hand_over(path: str) -> None:
        nonlocal changed
        info = os.lstat(path)
        if info.st_uid != uid or info.st_gid != gid:
            os.chown(path, uid, gid, follow_symlinks=False)
            changed += 1

    hand_over(str(root))
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: log.warning("skipped: %s", e)):
        for name in [*dirnames, *filenames]:
            try:
                hand_over(os.path.join(dirpath, name))
            except OSError as exc:
                log.warning("cannot hand over %s: %s", os.path.join(dirpath, name), exc)
    return changed
