"""Walk and change a tree someone else can write, relative to directory handles, never following a link.

A tenant's engines folder is written by the tenant's runtime pods (uid 10001, the agent's uid too), so
anything in it may be a symbolic link, a FIFO or a device planted to turn the agent's privileges against
another tenant: a link named like a build lock pointing at another tenant's weights, a group folder
pointing into another tenant's engines folder. Every step here is one ``openat``-style call on a
directory file descriptor with ``O_NOFOLLOW`` (a link in any component fails with ``UnsafePath``),
files are created with ``O_EXCL`` (never opened through an existing name, never truncated) and opened
read-only with ``O_NONBLOCK`` and checked with ``fstat`` (a FIFO or a device is refused, not read).

The caller opens the trusted top (the agent's own cache root, or a folder it created there) with
`open_dir`; everything below goes through the returned descriptors. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path component that is a link, or an entry that is neither a regular file nor a directory."""


def _refuse(exc: OSError, what: str) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EMLINK):
        return UnsafePath(exc.errno, f"{what}: a link or not a directory/regular file")
    return exc


def open_dir(name: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd`` when given); UnsafePath when it is a link."""
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except OSError as exc:
        raise _refuse(exc, str(name)) from exc


def open_dirs(top: int, parts: list[str]) -> int:
    """Descend from the descriptor ``top`` through ``parts`` (single names), each without following a link;
    the caller closes the returned descriptor (a new one, even for no parts)."""
    return _descend(top, parts, None)


def make_dirs(top: int, parts: list[str], mode: int = 0o755) -> int:
    """`open_dirs`, creating missing components (never through a link: an existing link is UnsafePath)."""
    return _descend(top, parts, mode)


def _descend(top: int, parts: list[str], create_mode: int | None) -> int:
    fd = os.dup(top)
    try:
        for part in parts:
            _check_name(part)
            if create_mode is not None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, create_mode, dir_fd=fd)
            nxt = open_dir(part, fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_name(part: str) -> None:
    if not part or part in (".", "..") or "/" in part or "\0" in part:
        raise UnsafePath(errno.EINVAL, f"not a single path component: {part!r}")


def open_regular(name: str, dir_fd: int) -> int:
    """A read-only descriptor of the regular file ``name`` in ``dir_fd``; UnsafePath for a link, a FIFO, a
    device or a directory (opened without blocking, checked on the descriptor itself)."""
    _check_name(name)
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError as exc:
        raise _refuse(exc, name) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(errno.EINVAL, f"{name}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def create_new(name: str, dir_fd: int, mode: int = 0o644) -> int:
    """A write descriptor of a new file ``name`` in ``dir_fd`` (O_EXCL: an existing name, a link included,
    is FileExistsError, never opened or truncated)."""
    _check_name(name)
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)


def open_lock(name: str, dir_fd: int) -> int:
    """A descriptor of the lock file ``name`` in ``dir_fd`` for ``flock``, created when missing, never
    truncated, never through a link; UnsafePath when the name holds anything but a regular file."""
    _check_name(name)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                     dir_fd=dir_fd)
    except OSError as exc:
        raise _refuse(exc, name) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePath(errno.EINVAL, f"{name}: not a regular file")
    return fd


def entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of every entry of ``dir_fd``, sorted by name (a link's own stat, never its target's)."""
    out = []
    with os.scandir(dir_fd) as it:
        names = [entry.name for entry in it]
    for name in sorted(names):
        try:
            out.append((name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)))
        except FileNotFoundError:
            continue
    return out


#: Folders deeper than this below a walk's top are refused (a tenant's tree could nest until the stack ends).
MAX_DEPTH = 32


def walk(dir_fd: int, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, str, int, os.stat_result]]:
    """Every non-directory below ``dir_fd``, depth first, sorted: (relative path, name, the descriptor of its
    folder, its lstat). Directories are entered by descriptor with O_NOFOLLOW; a link is yielded as what it
    is (S_ISLNK), never followed. The folder descriptor is valid only until the next item. UnsafePath past
    MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise UnsafePath(errno.ELOOP, f"{prefix}: more than {MAX_DEPTH} folders deep")
    for name, st in entries(dir_fd):
        rel = f"{prefix}{name}"
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = open_dir(name, dir_fd)
            except UnsafePath:  # replaced by a link since it was listed: report it as one
                yield rel, name, dir_fd, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                continue
            try:
                yield from walk(sub, rel + "/", depth + 1)
            finally:
                os.close(sub)
        else:
            yield rel, name, dir_fd, st


def remove_tree(name: str, dir_fd: int) -> None:
    """Delete ``name`` in ``dir_fd`` (a file, a link itself, or a directory and all below it), following no
    link (shutil's descriptor-based rmtree)."""
    _check_name(name)
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def tree_bytes(dir_fd: int) -> int:
    """Bytes of the regular files below ``dir_fd`` (links and special files count nothing)."""
    return sum(st.st_size for _, _, _, st in walk(dir_fd) if stat.S_ISREG(st.st_mode))
