"""The node agent's peer server: other nodes' agents read complete cache entries from here.

Read-only HTTP (aiohttp's server; files go out with ``sendfile``), two routes besides ``/healthz``:

* ``GET /v1/entries/<namespace>_sha256-<hex>/manifest``: JSON ``{"entry", "digest", "files": [{"path",
  "size", "sha256"}]}``, read from the entry's ``.manifest``; the fetcher checks it against the digest
  before it fetches a byte, and each file against its line;
* ``GET /v1/entries/<namespace>_sha256-<hex>/files/<path>``: one file the manifest lists.

What is never served: anything but a cache entry's name (the entry name is matched against its exact
form, so ``..``, ``/`` and the root's own files cannot be named); an entry without ``.ready`` naming the
digest in its name (a pull in progress lives in ``.tmp-*`` and is published by one rename, so it is never
seen half-written), a symlinked entry, a path the manifest does not list (``.ready``, ``.manifest``,
``.source.json`` included), a path that is a symlink or resolves outside the entry.

Engine builds (operator/cache/engines.py) go out the same way, per tenant engines folder and accelerator:

* ``GET /v1/engines/<namespace>_engines-sha256-<hex>/<accelerator>/manifest``: JSON ``{"entry",
  "accelerator", "builds": [{"group", "name", "files": [{"path", "size", "sha256"}]}]}``, the complete builds
  (`engines.list_builds`: real folders with the layout's names; a lock or a build in progress is never
  listed), a build holding a symlink or a special file left out;
* ``GET /v1/engines/<entry>/<accelerator>/files/<group>/<build>/<path>``: one file that listing gives.

Who may call it: with the release's peer key (`peer_auth`, the agent always has one), only a request signed
with it; anything else gets 401 and nothing more, and the JSON listings are signed for the request's nonce.
The chart's NetworkPolicy (only node-agent pods reach the port) and the pod-IP bind are a second fence,
not the only one: a hostNetwork pod or a CNI that does not enforce policies reaches the port, and reads
nothing without the key. Entries are asked for by tenant and digest together, and a fetching agent only
ever asks for the tenant whose entry it is filling. A tenant's engines folder is written by its pods, so
builds are listed, hashed and sent through directory descriptors without following a link (`safefs`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from pathlib import Path

from aiohttp import web

from . import safefs
from .digest import ENTRY_MANIFEST, READY_MARKER, DigestError, parse_manifest
from .engines import ACCELERATOR, ENGINES_ENTRY, PART, BuildUnavailable, build_files_at, list_builds
from .peer_auth import BODY_SIGNATURE, PeerKey, Refused, Verifier

log = logging.getLogger(__name__)

#: A tenant's entry: ``<namespace>_sha256-<64 hex>`` (the older tenant-less layout is never served).
PEER_ENTRY = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?_sha256-([0-9a-f]{64})$")
DEFAULT_PORT = 8476


class EntryUnavailable(Exception):
    """Not servable: missing, incomplete, or not what its name says."""


def entry_files(root: Path, entry: str) -> tuple[str, dict[str, tuple[str, int]]]:
    """(digest, path -> (sha256 hex, size)) of a complete entry; EntryUnavailable otherwise."""
    match = PEER_ENTRY.match(entry)
    if match is None:
        raise EntryUnavailable(f"not a cache entry name: {entry[:100]!r}")
    folder = root / entry
    if folder.is_symlink() or not folder.is_dir():
        raise EntryUnavailable(f"{entry}: not held here")
    digest = f"sha256:{match.group(1)}"
    try:
        named = (folder / READY_MARKER).read_text().strip()
        entries = parse_manifest((folder / ENTRY_MANIFEST).read_bytes())
    except (OSError, DigestError, UnicodeDecodeError) as exc:
        raise EntryUnavailable(f"{entry}: not complete ({type(exc).__name__})") from exc
    if named != digest:
        raise EntryUnavailable(f"{entry}: its {READY_MARKER} names another digest")
    files: dict[str, tuple[str, int]] = {}
    for sha, rel in entries:
        try:
            st = os.lstat(folder / rel)
        except OSError as exc:
            raise EntryUnavailable(f"{entry}: {rel} is missing") from exc
        files[rel] = (sha, st.st_size)
    return digest, files


def _inside(folder: Path, rel: str) -> Path | None:
    """The file ``rel`` of ``folder`` when it is a regular file whose real path stays inside ``folder``."""
    path = folder / rel
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(path)
    if not real.startswith(real_folder + os.sep) or path.is_symlink() or not path.is_file():
        return None
    return path


def _open_engines(root: Path, entry: str, accelerator: str) -> int:
    """A descriptor of the tenant's engines folder ``root/entry`` (the agent made it in its own root; not a
    link); EntryUnavailable for a name outside the layout or a folder not held here."""
    if ENGINES_ENTRY.match(entry) is None or ACCELERATOR.match(accelerator) is None:
        raise EntryUnavailable(f"not an engines folder and accelerator: {entry[:100]!r}/{accelerator[:70]!r}")
    try:
        return safefs.open_dir(root / entry)
    except OSError as exc:
        raise EntryUnavailable(f"{entry}: not held here") from exc


def engine_listing(root: Path, entry: str, accelerator: str) -> list[dict[str, object]]:
    """The complete, plain builds of ``entry`` for ``accelerator``; EntryUnavailable for a name outside the
    layout. The folder is a tenant's (its runtimes write it): each build is opened component by component
    without following a link, and one holding anything but regular files and folders is left out."""
    entry_fd = _open_engines(root, entry, accelerator)
    out: list[dict[str, object]] = []
    try:
        for build in list_builds(root / entry, accelerator):
            try:
                build_fd = safefs.open_dirs(entry_fd, [build.accelerator, build.group, build.name])
                try:
                    files = build_files_at(build_fd, build.rel)
                finally:
                    os.close(build_fd)
            except (BuildUnavailable, OSError) as exc:
                log.warning("not offering %s/%s: %s", entry, build.rel, exc)
                continue
            out.append({"group": build.group, "name": build.name,
                        "files": [{"path": rel, "size": size, "sha256": sha} for rel, size, sha in files]})
    finally:
        os.close(entry_fd)
    return out


def open_build_file(root: Path, entry: str, accelerator: str, group: str, name: str, rel: str) -> int:
    """A read descriptor of one file of a build, reached by descriptors without following a link and
    checked to be a regular file; EntryUnavailable otherwise."""
    entry_fd = _open_engines(root, entry, accelerator)
    try:
        *parents, last = rel.split("/")
        folder = safefs.open_dirs(entry_fd, [accelerator, group, name, *parents])
        try:
            return safefs.open_regular(last, folder)
        finally:
            os.close(folder)
    except OSError as exc:
        raise EntryUnavailable(f"{entry}/{accelerator}/{group}/{name}/{rel}: {exc}") from exc
    finally:
        os.close(entry_fd)


async def _send_fd(request: web.Request, fd: int, size: int) -> web.StreamResponse:
    """Stream exactly ``size`` bytes of the open file ``fd`` (closed here)."""
    try:
        response = web.StreamResponse(headers={"Cache-Control": "no-store",
                                               "Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        left = size
        while left > 0:
            chunk = await asyncio.to_thread(os.read, fd, min(left, 1 << 20))
            if not chunk:
                break
            left -= len(chunk)
            await response.write(chunk)
        await response.write_eof()
        return response
    finally:
        os.close(fd)


def _auth_middleware(verifier: Verifier):
    """Every route but ``/healthz`` needs an agent's signed request (`peer_auth`): 401 and nothing else
    otherwise; a JSON answer (a listing) is signed for the request's nonce."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path == "/healthz":
            return await handler(request)
        try:
            nonce = verifier.check(request.method, request.raw_path, request.headers)
        except Refused as exc:
            log.warning("refused a request from %s: %s", request.remote, exc)
            return web.Response(status=401, text="peer credentials required\n")
        response = await handler(request)
        if isinstance(response, web.Response) and isinstance(response.body, bytes):
            response.headers[BODY_SIGNATURE] = verifier.sign_body(nonce, response.body)
        return response
    return middleware


def make_app(root: Path, key: PeerKey | None = None) -> web.Application:
    """The peer routes over ``root``; with ``key``, only for callers that sign with it (`peer_auth`)."""
    async def manifest(request: web.Request) -> web.Response:
        entry = request.match_info["entry"]
        try:
            digest, files = await asyncio.to_thread(entry_files, root, entry)
        except EntryUnavailable as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc
        return web.json_response({"entry": entry, "digest": digest, "files": [
            {"path": rel, "size": size, "sha256": sha} for rel, (sha, size) in files.items()]})

    async def file(request: web.Request) -> web.StreamResponse:
        entry, rel = request.match_info["entry"], request.match_info["path"]
        try:
            _, files = await asyncio.to_thread(entry_files, root, entry)
        except EntryUnavailable as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc
        path = _inside(root / entry, rel) if rel in files else None
        if path is None:
            raise web.HTTPNotFound(text=f"{entry}: serves only the files its manifest lists")
        log.info("serving %s/%s (%d bytes) to %s", entry, rel, files[rel][1], request.remote)
        return web.FileResponse(path, headers={"Cache-Control": "no-store"})

    async def engines_manifest(request: web.Request) -> web.Response:
        entry, accelerator = request.match_info["entry"], request.match_info["accelerator"]
        try:
            builds = await asyncio.to_thread(engine_listing, root, entry, accelerator)
        except EntryUnavailable as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc
        return web.json_response({"entry": entry, "accelerator": accelerator, "builds": builds})

    async def engine_file(request: web.Request) -> web.StreamResponse:
        entry, accelerator = request.match_info["entry"], request.match_info["accelerator"]
        group, name, rel = request.match_info["group"], request.match_info["build"], request.match_info["path"]
        if not (PART.match(group) and PART.match(name)):
            raise web.HTTPNotFound(text="not a build name")
        try:
            builds = await asyncio.to_thread(engine_listing, root, entry, accelerator)
        except EntryUnavailable as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc
        listed = {f["path"]: f["size"] for b in builds if b["group"] == group and b["name"] == name
                  for f in b["files"]}  # type: ignore[union-attr]
        if rel not in listed:
            raise web.HTTPNotFound(text=f"{entry}: serves only the files of a complete build's listing")
        try:
            fd = await asyncio.to_thread(open_build_file, root, entry, accelerator, group, name, rel)
        except EntryUnavailable as exc:
            raise web.HTTPNotFound(text=str(exc)) from exc
        log.info("serving engine %s/%s/%s/%s/%s (%d bytes) to %s", entry, accelerator, group, name, rel,
                 listed[rel], request.remote)
        return await _send_fd(request, fd, int(listed[rel]))  # type: ignore[call-overload]

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application(middlewares=[_auth_middleware(Verifier(key))] if key is not None else [])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/entries/{entry}/manifest", manifest)
    app.router.add_get("/v1/entries/{entry}/files/{path:.+}", file)
    app.router.add_get("/v1/engines/{entry}/{accelerator}/manifest", engines_manifest)
    app.router.add_get("/v1/engines/{entry}/{accelerator}/files/{group}/{build}/{path:.+}", engine_file)
    return app


class PeerServer:
    """The peer server on its own event loop in a daemon thread (the agent's loop is synchronous)."""

    def __init__(self, root: Path, host: str, port: int, key: PeerKey | None = None) -> None:
        self.root, self.host, self.port, self.key = root, host, port, key
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="peer-server", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._runner = web.AppRunner(make_app(self.root, self.key), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def start(self) -> PeerServer:
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise OSError(f"peer server cannot listen on {self.host}:{self.port}: {self._error}")
        log.info("peer server: serving complete entries of %s on %s:%d", self.root, self.host, self.port)
        return self

    def stop(self) -> None:
        if self._runner is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


def serve(root: Path, host: str, port: int, key: PeerKey | None = None) -> int:
    """Serve in the foreground until SIGTERM/SIGINT (``embedfleet cache serve-peers``)."""
    if key is None:
        log.warning("peer server without a key: any caller that reaches %s:%d is served", host, port)
    web.run_app(make_app(root, key), host=host, port=port, access_log=None, print=None,
                handle_signals=True, shutdown_timeout=5)
    return 0
