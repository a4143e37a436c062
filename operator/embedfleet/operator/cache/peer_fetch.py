"""Fetch one cache entry from another node's agent (`peer_server`), verifying every byte.

The peer's manifest must prove the digest on its own (`peers.manifest_proves`) before any file is
fetched, and each file must arrive with exactly the size and sha256 its line gives: a peer with a
damaged disk, an older entry under the same name, or a stalled link raises `PeerFailed`, and the caller
goes on to the next peer and finally the origin. Downloads go through a `TokenBucket` when one is given.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from .digest import DigestError, safe_relpath
from .peer_auth import PeerKey, SignedRequests
from .peer_auth import client as peer_client
from .peers import TokenBucket, manifest_proves
from .sources import FetchError

_CHUNK = 1 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")


class PeerFailed(FetchError):
    """This peer cannot give this entry (missing there, unreachable, or bytes that do not verify)."""


def get_json(client: httpx.Client, url: str) -> Any:
    """The JSON body of a 200 answer to ``GET url``; PeerFailed for a transport error, another status or a body
    that is not JSON (the peer routes' listings)."""
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise PeerFailed(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise PeerFailed(f"GET {url}: HTTP {response.status_code}")
    if isinstance(client.auth, SignedRequests) and not client.auth.verify(response):
        raise PeerFailed(f"GET {url}: the listing is not signed with the release's peer key (not an agent, or "
                         "altered on the way)")
    try:
        return response.json()
    except ValueError as exc:
        raise PeerFailed(f"GET {url}: not JSON ({exc})") from exc


def _manifest(client: httpx.Client, base: str, entry: str) -> list[tuple[str, str, int]]:
    url = f"{base}/v1/entries/{entry}/manifest"
    body = get_json(client, url)
    try:
        files = body["files"]
        out = [(str(f["sha256"]), safe_relpath(str(f["path"])), int(f["size"])) for f in files]
    except (ValueError, KeyError, TypeError, DigestError) as exc:
        raise PeerFailed(f"GET {url}: not a manifest ({type(exc).__name__}: {exc})") from exc
    if not out or any(not _HEX.match(sha) or size < 0 for sha, _, size in out):
        raise PeerFailed(f"GET {url}: a manifest with no files, a bad sha256 or a negative size")
    if len({rel for _, rel, _ in out}) != len(out):
        raise PeerFailed(f"GET {url}: the manifest lists a path twice")
    return out


def download_verified(client: httpx.Client, url: str, target: Path, sha: str, size: int,
                      bucket: TokenBucket | None) -> None:
    """Stream ``url`` into ``target``: exactly ``size`` bytes with sha256 ``sha``, else PeerFailed."""
    h = hashlib.sha256()
    got = 0
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with client.stream("GET", url) as response, target.open("wb") as fh:
            if response.status_code != 200:
                raise PeerFailed(f"GET {url}: HTTP {response.status_code}")
            for chunk in response.iter_raw(_CHUNK):
                got += len(chunk)
                if got > size:
                    raise PeerFailed(f"GET {url}: more than the {size} bytes its manifest gives")
                if bucket is not None:
                    bucket.take(len(chunk))
                h.update(chunk)
                fh.write(chunk)
    except httpx.HTTPError as exc:
        raise PeerFailed(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if got != size or h.hexdigest() != sha:
        raise PeerFailed(f"GET {url}: {got} bytes with sha256 {h.hexdigest()}, the manifest says {size} bytes "
                         f"with sha256 {sha}")


def fetch_from_peer(base: str, entry: str, expected_hex: str, dest: Path, timeout: float = 60.0,
                    bucket: TokenBucket | None = None,
                    max_bytes: int | None = None,
                    key: PeerKey | None = None) -> tuple[str, int, list[tuple[str, str]]]:
    """Fill the empty directory ``dest`` with ``entry`` from the agent at ``base``; return (what was fetched,
    bytes, the verified (sha256, path) of every file: ``dest``'s manifest, with no second read).
    ``timeout`` bounds connecting and each read (a peer that stops sending fails, not hangs)."""
    with peer_client(timeout, key) as client:
        files = _manifest(client, base, entry)
        if not manifest_proves([(sha, rel) for sha, rel, _ in files], expected_hex):
            raise PeerFailed(f"{base}: the manifest of {entry} does not prove sha256:{expected_hex} (an "
                             "archive source's unpacked files, or other weights): fetched from the origin")
        total = sum(size for _, _, size in files)
        if max_bytes is not None and total > max_bytes:
            raise PeerFailed(f"{base}: {entry} holds {total} bytes, more than the limit of {max_bytes}")
        for sha, rel, size in files:
            url = f"{base}/v1/entries/{entry}/files/{quote(rel)}"
            download_verified(client, url, dest / rel, sha, size, bucket)
    return f"peer {base} ({len(files)} files)", total, [(sha, rel) for sha, rel, _ in files]
