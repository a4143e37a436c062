"""Fetchers: put the bytes a source URL names into an empty directory, verifying them on the way.

Each fetcher leaves ``dest`` holding exactly the model's files and raises `FetchError` (worth a retry:
network trouble, a server error, bytes that do not match the digest) or `UnsupportedSource` (retrying
cannot help: unknown scheme, missing tool or credentials, malformed manifest, more bytes than allowed).

``max_bytes`` bounds what one pull may download over http(s) (all files together): a source that
announces more (Content-Length) is refused before its body is read, and a stream that goes past the
limit is cut off there, so a wrong or hostile URL cannot fill a node's disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

import httpx

from .digest import (
    MANIFEST_NAME,
    DigestError,
    file_sha256,
    parse_manifest,
    render_manifest,
    tree_digest,
)

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_CHUNK = 1 << 20


class FetchError(Exception):
    """A failure a later attempt may not repeat."""


class UnsupportedSource(Exception):
    """A failure no retry can fix; the message says what would."""


class TooLarge(UnsupportedSource):
    """The source is larger than ``max_bytes``; retrying would download the same bytes again."""


class _Budget:
    """Bytes one pull may still download (None: unlimited), shared by all the files of a source."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.used = 0

    def announce(self, url: str, length: str | None) -> None:
        if self.max_bytes is None or length is None or not length.isdigit():
            return
        if self.used + int(length) > self.max_bytes:
            raise TooLarge(f"GET {url}: Content-Length {length} would take this pull past its limit of "
                           f"{self.max_bytes} bytes (--max-bytes)")

    def take(self, url: str, n: int) -> None:
        self.used += n
        if self.max_bytes is not None and self.used > self.max_bytes:
            raise TooLarge(f"GET {url}: more than {self.max_bytes} bytes downloaded (--max-bytes); stopped")


_NEEDS = {
    "s3": "s3:// needs the AWS CLI or boto3 and credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an "
    "IRSA role); use a presigned https:// URL to a .tar archive, or an http(s) directory with a SHA256SUMS "
    "manifest, instead",
    "gs": "gs:// needs gcloud/gsutil or google-cloud-storage and credentials (GOOGLE_APPLICATION_CREDENTIALS "
    "or Workload Identity); use a signed https:// URL to a .tar archive, or an http(s) directory with a "
    "SHA256SUMS manifest, instead",
    "pvc": "pvc:// is mounted, not pulled: mount the claim into the pod and pass file:///mount/path",
}


def fetch(
    source: str, dest: Path, expected_hex: str, timeout: float = 60.0, max_bytes: int | None = None
) -> str:
    """Fill ``dest`` from ``source``; return a short description of what was fetched."""
    scheme = urlparse(source).scheme.lower()
    budget = _Budget(max_bytes)
    if scheme in ("http", "https"):
        return _fetch_http(source, dest, expected_hex, timeout, budget)
    if scheme == "file":
        return _fetch_file(Path(unquote(urlparse(source).path)), dest, expected_hex)
    if scheme == "hf":
        return _fetch_hf(source, dest, expected_hex, timeout, budget)
    if scheme in _NEEDS:
        raise UnsupportedSource(_NEEDS[scheme])
    raise UnsupportedSource(f"unsupported source scheme {scheme!r} in {source!r}; use http(s):// or file://")


def _is_archive(name: str) -> bool:
    return name.endswith(ARCHIVE_SUFFIXES)


def _check(actual_hex: str, expected_hex: str, what: str) -> None:
    if actual_hex != expected_hex:
        raise FetchError(f"digest mismatch for {what}: got sha256:{actual_hex}, want sha256:{expected_hex}")


def _extract(archive: Path, dest: Path) -> None:
    """Unpack with tarfile's 'data' filter: no absolute paths, no escapes, no devices or links out."""
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise FetchError(f"cannot unpack {archive.name}: {exc}") from exc
    archive.unlink()


def _fetch_file(path: Path, dest: Path, expected_hex: str) -> str:
    if path.is_dir():
        shutil.copytree(path, dest, dirs_exist_ok=True, symlinks=False)
        _check(tree_digest(dest).removeprefix("sha256:"), expected_hex, f"directory {path}")
        return f"directory {path}"
    if not path.is_file():
        raise UnsupportedSource(f"file source does not exist: {path}")
    target = dest / path.name
    shutil.copyfile(path, target)
    _check(file_sha256(target), expected_hex, str(path))
    if _is_archive(path.name):
        _extract(target, dest)
        return f"archive {path}"
    return f"file {path}"


def _download(client: httpx.Client, url: str, target: Path, budget: _Budget) -> str:
    """Stream ``url`` into ``target``; return the sha256 hex of what arrived."""
    h = hashlib.sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with client.stream("GET", url) as response:
            if response.status_code in (408, 429) or response.status_code >= 500:
                raise FetchError(f"GET {url}: HTTP {response.status_code}")
            if response.status_code >= 400:
                raise UnsupportedSource(f"GET {url}: HTTP {response.status_code}")
            budget.announce(url, response.headers.get("content-length"))
            with target.open("wb") as fh:
                for chunk in response.iter_bytes(_CHUNK):
                    budget.take(url, len(chunk))
                    h.update(chunk)
                    fh.write(chunk)
    except httpx.HTTPError as exc:
        raise FetchError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    return h.hexdigest()


def _fetch_http(url: str, dest: Path, expected_hex: str, timeout: float, budget: _Budget) -> str:
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        if url.endswith("/"):
            return _fetch_http_directory(client, url, dest, expected_hex, budget)
        name = Path(unquote(urlparse(url).path)).name or "model"
        target = dest / name
        _check(_download(client, url, target, budget), expected_hex, url)
        if _is_archive(name):
            _extract(target, dest)
            return f"archive {url}"
        return f"file {url}"


def _fetch_http_directory(client: httpx.Client, url: str, dest: Path, expected_hex: str, budget: _Budget) -> str:
    """A directory published as ``<url>SHA256SUMS`` plus the files it lists, relative to ``url``."""
    manifest_path = dest.parent / (dest.name + ".manifest")
    try:
        _download(client, url + MANIFEST_NAME, manifest_path, budget)
        try:
            entries = parse_manifest(manifest_path.read_bytes())
        except (DigestError, UnicodeDecodeError) as exc:
            raise FetchError(f"{url}{MANIFEST_NAME}: {exc}") from exc
    finally:
        manifest_path.unlink(missing_ok=True)
    # The directory digest is the sha256 of the canonical manifest: check it before fetching any file.
    _check(hashlib.sha256(render_manifest(entries)).hexdigest(), expected_hex, f"{url}{MANIFEST_NAME}")
    for sha, rel in entries:
        _check(_download(client, url + quote(rel), dest / rel, budget), sha, url + rel)
    _check(tree_digest(dest).removeprefix("sha256:"), expected_hex, f"directory {url}")
    return f"directory {url} ({len(entries)} files)"


# Files a runtime needs from a Hub repository; other weights formats (onnx/, openvino/, *.bin when
# safetensors exist, TF/Flax/Rust) are skipped so the cache holds one copy of the weights.
HF_KEEP_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".py")
HF_SKIP_DIRS = ("onnx/", "openvino/", "coreml/", "tf_model", "flax_model", "rust_model")


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def parse_hf(source: str) -> tuple[str, str]:
    """`hf://org/name[@revision]` -> (repo id, revision)."""
    rest = source.removeprefix("hf://")
    repo, _, revision = rest.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UnsupportedSource(f"hf:// source must be hf://ORG/NAME[@REVISION], got {source!r}")
    return repo, revision or "main"


def hf_files(siblings: list[str]) -> list[str]:
    files = [f for f in siblings if f.endswith(HF_KEEP_SUFFIXES) and not f.startswith(HF_SKIP_DIRS)]
    if not any(f.endswith(".safetensors") for f in files):
        files += [f for f in siblings if f == "pytorch_model.bin" or f.startswith("pytorch_model-")]
    return sorted(set(files))


def _fetch_hf(source: str, dest: Path, expected_hex: str, timeout: float, budget: _Budget) -> str:
    """The Hub's public HTTP API: list the revision's files, then resolve each one (HF_TOKEN if set)."""
    repo, revision = parse_hf(source)
    headers = {"authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}
    base = hf_endpoint()
    with httpx.Client(timeout=timeout, follow_redirects=True, headers=headers) as client:
        try:
            info = client.get(f"{base}/api/models/{repo}/revision/{quote(revision, safe='')}")
        except httpx.HTTPError as exc:
            raise FetchError(f"listing {repo}@{revision}: {type(exc).__name__}: {exc}") from exc
        if info.status_code in (401, 403, 404):
            raise UnsupportedSource(f"{repo}@{revision}: HTTP {info.status_code} (missing, gated or private: "
                                    "set HF_TOKEN)")
        if info.status_code != 200:
            raise FetchError(f"listing {repo}@{revision}: HTTP {info.status_code}")
        commit = info.json().get("sha") or revision
        files = hf_files([s["rfilename"] for s in info.json().get("siblings", [])])
        if "config.json" not in files:
            raise UnsupportedSource(f"{repo}@{revision} has no config.json: not a model repository")
        for rel in files:
            _download(client, f"{base}/{repo}/resolve/{commit}/{quote(rel)}", dest / rel, budget)
    _check(tree_digest(dest).removeprefix("sha256:"), expected_hex, f"{repo}@{revision}")
    return f"hf {repo}@{commit} ({len(files)} files)"
