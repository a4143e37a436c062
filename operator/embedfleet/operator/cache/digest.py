"""The digest that keys the cache, for a single file and for a directory.

A file's digest is ``sha256:`` + the hex sha256 of its bytes (what ``sha256sum`` prints).

A directory's digest is the sha256 of its *manifest*: one line per regular file, sorted by relative
POSIX path (byte order of the UTF-8 path), each line ``<file sha256 hex>  <relative path>\\n`` — exactly
the ``sha256sum`` format, so a shell can reproduce it::

    (cd DIR && find . -type f ! -name .ready ! -name .manifest ! -name .source.json ! -name SHA256SUMS \\
        -printf '%P\\n' | LC_ALL=C sort \\
        | xargs -d '\\n' sha256sum) | sha256sum

Four names at the top level are left out because they describe the directory rather than belong to
it: ``SHA256SUMS`` (the manifest itself, published next to the files for http(s) directory sources),
``.ready``, ``.manifest`` and ``.source.json`` (the cache's own marker, its record of the unpacked tree,
and its record of where the bytes came from). Symlinks and
empty directories are not part of a model and are ignored; file modes and times never count.

`verify_entry` is what the runtime runs before it loads a cache entry. This module imports only the
standard library, so the runtime (``embedfleet serve``) imports it without the operator's dependencies.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

MANIFEST_NAME = "SHA256SUMS"
READY_MARKER = ".ready"
#: Written by the puller next to ``.ready``: the verified, unpacked tree in ``sha256sum`` format.
ENTRY_MANIFEST = ".manifest"
#: Written by the puller next to ``.ready``: where the weights came from (peer, origin) and how long it took.
SOURCE_RECORD = ".source.json"
EXCLUDED_TOP_LEVEL = frozenset({MANIFEST_NAME, READY_MARKER, ENTRY_MANIFEST, SOURCE_RECORD})
DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_CHUNK = 1 << 20


class DigestError(ValueError):
    """A digest string or a manifest that does not follow the definition above."""


def parse_digest(digest: str) -> str:
    """Return the hex part of ``sha256:<64 hex>``; anything else is refused with the expected form."""
    match = DIGEST_RE.match(digest.strip())
    if not match:
        raise DigestError(f"digest must look like sha256:<64 lowercase hex>, got {digest!r}")
    return match.group(1)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                continue
            rel = (rel_dir / name).as_posix()
            if rel in EXCLUDED_TOP_LEVEL:
                continue
            found.append(rel)
    return sorted(found, key=lambda p: p.encode())


def manifest_lines(root: Path) -> list[tuple[str, str]]:
    """(file sha256 hex, relative path) for every file the directory digest covers, in digest order."""
    return [(file_sha256(root / rel), rel) for rel in _files(root)]


def render_manifest(entries: Iterable[tuple[str, str]]) -> bytes:
    ordered = sorted(entries, key=lambda e: e[1].encode())
    return "".join(f"{sha}  {rel}\n" for sha, rel in ordered).encode()


def safe_relpath(rel: str) -> str:
    """Refuse manifest paths that could escape the cache directory or collide with our own names."""
    path = PurePosixPath(rel)
    bad_part = any(part in ("", ".", "..") for part in rel.split("/"))
    if not rel or "\\" in rel or path.is_absolute() or bad_part:
        raise DigestError(f"unsafe path in manifest: {rel!r}")
    if rel in EXCLUDED_TOP_LEVEL:
        raise DigestError(f"manifest may not list {rel!r}")
    return rel


def parse_manifest(text: bytes) -> list[tuple[str, str]]:
    """Read a ``sha256sum``-format manifest (``<hex>  <path>`` or ``<hex> *<path>``)."""
    entries: list[tuple[str, str]] = []
    for number, raw in enumerate(text.decode("utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        match = re.match(r"^([0-9a-f]{64}) [ *](.+)$", raw)
        if not match:
            raise DigestError(f"manifest line {number} is not '<sha256 hex>  <path>': {raw[:80]!r}")
        entries.append((match.group(1), safe_relpath(match.group(2))))
    if not entries:
        raise DigestError("manifest lists no files")
    if len({rel for _, rel in entries}) != len(entries):
        raise DigestError("manifest lists a path twice")
    return entries


def tree_digest(root: Path) -> str:
    """``sha256:`` digest of a file or a directory, as defined in the module docstring."""
    if root.is_file():
        return "sha256:" + file_sha256(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no such file or directory: {root}")
    return "sha256:" + hashlib.sha256(render_manifest(manifest_lines(root))).hexdigest()


class VerifyError(DigestError):
    """A cache entry that is not what its digest says: the runtime refuses to load it."""


def verify_entry(root: Path, digest: str) -> str:
    """Check a cache entry before loading it; return how strongly it was checked, or raise VerifyError.

    ``.ready`` must name ``digest`` (an entry of other weights, or a half-written one, is refused), and
    every regular file in the tree must be listed in ``.manifest`` with its sha256, and nothing more or
    less. When the manifest itself hashes to the digest (directory sources) or the tree is the single
    file the digest names, the files are proven to be the published ones ("digest"); for archives the
    digest covers the archive, which is gone, so the files are proven to be what the puller verified
    and unpacked ("manifest"). An entry without a manifest (an older puller) is checked by recomputing
    the tree digest.
    """
    expected_hex = parse_digest(digest)
    marker = root / READY_MARKER
    if not marker.is_file():
        raise VerifyError(f"{root}: no {READY_MARKER} marker: the weights were never verified there")
    named = marker.read_text(errors="replace").strip()
    if named != f"sha256:{expected_hex}":
        raise VerifyError(f"{root}/{READY_MARKER} names {named[:80]!r}, not the expected sha256:{expected_hex}")
    manifest = root / ENTRY_MANIFEST
    if not manifest.is_file():
        actual = tree_digest(root)
        if actual != f"sha256:{expected_hex}":
            raise VerifyError(f"{root}: has no {ENTRY_MANIFEST} and its tree digest is {actual}, "
                              f"not sha256:{expected_hex}")
        return "digest"
    try:
        entries = parse_manifest(manifest.read_bytes())
    except (DigestError, UnicodeDecodeError) as exc:
        raise VerifyError(f"{root}/{ENTRY_MANIFEST}: {exc}") from exc
    listed = {rel: sha for sha, rel in entries}
    present = set(_files(root))
    if missing := sorted(set(listed) - present):
        raise VerifyError(f"{root}: {len(missing)} file(s) of the manifest are missing, e.g. {missing[0]!r}")
    if extra := sorted(present - set(listed)):
        raise VerifyError(f"{root}: {len(extra)} file(s) not in the manifest, e.g. {extra[0]!r}")
    for rel, sha in sorted(listed.items()):
        actual_sha = file_sha256(root / rel)
        if actual_sha != sha:
            raise VerifyError(f"{root}/{rel}: sha256 {actual_sha} does not match the manifest's {sha} "
                              "(changed after it was verified)")
    if hashlib.sha256(render_manifest(entries)).hexdigest() == expected_hex:
        return "digest"
    if len(entries) == 1 and entries[0][0] == expected_hex:
        return "digest"
    return "manifest"
