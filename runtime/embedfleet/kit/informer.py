"""An informer: one list + watch of one collection on one API server, kept in memory.

Readers (the hub's rounds, the gateway's routes) read these views, never the API servers: the calls are one
list per collection when it starts (or when a watch's version has expired) and one long watch each, whatever
the number of objects; each change costs one event, and ``on_change`` hears its key (a relist reports only
the keys whose ``resourceVersion`` changed, deletions included). The watch resumes from the newest version it
saw (events and bookmarks), so a watch the server ends after ``timeout_seconds`` costs no list; a ``410 Gone``
(the version was compacted away, or the server restarted) re-lists, as client-go's reflector does.

A list comes in pages of ``page_size`` objects (``limit``/``continue``), so a large collection never
arrives as one answer; a continue token that expired meanwhile (410) falls back to one full list, as
client-go's pager does. Relists forced one after another (a 410 again before the new watch delivered
anything) wait `relist_delay`: growing from ``relist_backoff[0]`` to at most ``relist_backoff[1]``, with
jitter, so a server that keeps answering 410 is not listed in a tight loop by every informer at once.

``error`` is set while the API server cannot be reached (and cleared when it can): a round treats such a
view as unknown, not as empty. ``resource_version`` lets the hub wait until its own writes are visible in
the view before it judges that spoke again (no second write of what it just wrote).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from embedfleet.kit.client import KubeClient, KubeError, describe

log = logging.getLogger(__name__)

#: Seconds the server keeps a watch open before this side re-opens it from the newest version (client-go
#: picks 5-10 minutes). Shorter than that: the read time-out, which detects a silently dropped connection,
#: is this plus a little.
WATCH_SECONDS = 60
#: Objects per LIST page (client-go's pager asks for 500).
PAGE_SIZE = 500
#: Seconds between relists forced one after another: client-go's reflector backs off from 800 ms to 30 s.
RELIST_BACKOFF = (0.8, 30.0)


def relist_delay(consecutive: int, backoff: tuple[float, float], rand: float) -> float:
    """Seconds to wait before the ``consecutive``-th relist in a row. The first (after a watch that worked)
    goes at once; then ``backoff[0]`` doubling up to ``backoff[1]``, of which a random share (``rand`` in
    [0, 1)) of the upper half is taken off, so informers hit by the same 410 spread out. Never more than
    ``backoff[1]``."""
    if consecutive <= 1:
        return 0.0
    step = min(backoff[1], backoff[0] * 2.0 ** min(consecutive - 2, 64))
    return step * (1.0 - 0.5 * min(max(rand, 0.0), 1.0))


def _version_of(obj: Mapping[str, Any] | None) -> tuple[str, str] | None:
    if obj is None:
        return None
    meta = obj.get("metadata") or {}
    return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")


def changed_keys(old: Mapping[str, Mapping[str, Any]], fresh: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """Keys added, deleted, or whose object changed (another uid or resourceVersion) between two views."""
    return {k for k in set(old) | set(fresh) if _version_of(old.get(k)) != _version_of(fresh.get(k))}


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta.get("name"))


def version_at_least(have: str, want: str) -> bool:
    """Whether resourceVersion ``have`` is ``want`` or newer. Versions are opaque to clients in principle;
    every API server backed by etcd issues increasing integers, which the hub relies on only to know when
    its own write has come back through the watch (a wrong guess costs one round of waiting, never a
    wrong write)."""
    try:
        return int(have) >= int(want)
    except ValueError:
        return have == want


@dataclass
class InformerStats:
    lists: int = 0
    watches: int = 0
    events: int = 0
    relists: int = 0  # lists forced by an expired version (410)
    pages: int = 0  # LIST answers, pages of a paginated list included
    expired_continues: int = 0  # paginated lists whose continue token expired (then listed in full)


class Informer:
    """Keeps ``items`` (by ``namespace/name``) equal to the collection at ``path`` on ``kube``'s server."""

    def __init__(
        self,
        kube: KubeClient,
        path: str,
        *,
        name: str,
        label_selector: str | None = None,
        field_selector: str | None = None,
        on_change: Callable[[str], None] | None = None,
        kind: str = "",
        timeout_seconds: int = WATCH_SECONDS,
        backoff: tuple[float, float] = (0.5, 10.0),
        on_restart: Callable[[str], None] | None = None,
        page_size: int = PAGE_SIZE,
        relist_backoff: tuple[float, float] = RELIST_BACKOFF,
        rng: random.Random | None = None,
    ) -> None:
        self.kube = kube
        self.path = path
        self.name = name
        #: The metrics' label: what is watched (bounded, unlike ``name``, which names a spoke).
        self.kind = kind or path.rstrip("/").rsplit("/", 1)[-1]
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.on_change = on_change
        self.timeout_seconds = timeout_seconds
        self.backoff = backoff
        self.page_size = page_size
        self.relist_backoff = relist_backoff
        self._rng = rng or random.Random()
        #: Whether the current watch delivered anything (an event or a bookmark) since the last list.
        self._progress = False
        #: Told the informer's ``kind`` each time a watch is opened again after a failure or an expired
        #: version (a component's watch-restart counter).
        self.on_restart = on_restart
        self.stats = InformerStats()
        self._items: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._rv = ""
        self._listed = threading.Event()
        self._error: str | None = None
        self._exception: BaseException | None = None
        self._stop = threading.Event()
        self._response: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ reading

    def items(self) -> dict[str, dict[str, Any]]:
        """A snapshot (a new dict; the objects are shared: do not change them)."""
        with self._lock:
            return dict(self._items)

    def get(self, key: str) -> dict[str, Any] | None:
        """The object under ``namespace/name`` (or ``name``), as last seen; do not change it."""
        with self._lock:
            return self._items.get(key)

    def holds(self, obj: Mapping[str, Any]) -> bool:
        """Whether this very object (same key and uid) is still in the cache: False once its DELETED event
        arrived, so a long round does not write to what was deleted meanwhile."""
        meta = obj.get("metadata") or {}
        with self._lock:
            held = self._items.get(object_key(obj))
        return held is not None and (held.get("metadata") or {}).get("uid") == meta.get("uid")

    @property
    def resource_version(self) -> str:
        return self._rv

    @property
    def synced(self) -> bool:
        """Listed at least once, and the API server answered the last call."""
        return self._listed.is_set() and self._error is None

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def exception(self) -> BaseException | None:
        """The last failure itself (to tell a credential problem from an unreachable server)."""
        return self._exception if self._error is not None else None

    def wait_synced(self, timeout: float) -> bool:
        return self._listed.wait(timeout)

    def caught_up(self, version: str) -> bool:
        """Whether the view already shows the server's state as of ``version`` (a write's answer)."""
        return not version or version_at_least(self._rv, version)

    # ------------------------------------------------------------ running

    def start(self) -> Informer:
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the watch's read at once
            except (AttributeError, OSError, ValueError):  # ValueError: urllib3's, when already shut (stop twice)
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        delay = self.backoff[0]
        version = ""
        relists = 0  # relists in a row with nothing delivered between them
        while not self._stop.is_set():
            try:
                if not version:
                    version = self._list()
                version = self._watch(version)
                delay = self.backoff[0]
                relists = 0
            except KubeError as exc:
                if exc.status == 410:
                    version = ""
                    relists = 1 if self._progress else relists + 1
                    self.stats.relists += 1
                    self._restarted()
                    if self._stop.wait(relist_delay(relists, self.relist_backoff, self._rng.random())):
                        return
                    continue
                if self._stop.is_set():
                    return
                self._failed(exc)
            except Exception as exc:  # unreachable, TLS, a broken stream: reported, retried with back-off
                if self._stop.is_set():  # stop() cut the stream: not a failure
                    return
                self._failed(exc)
            else:
                continue
            if self._stop.wait(delay):
                return
            self._restarted()
            delay = min(delay * 2, self.backoff[1])

    def _restarted(self) -> None:
        if self.on_restart is not None:
            try:
                self.on_restart(self.kind)
            except Exception:  # a metric's bug must not stop the informer
                log.exception("informer %s: restart hook failed", self.name)

    def _failed(self, exc: BaseException) -> None:
        text = describe(exc)
        if text != self._error:
            log.warning("informer %s: %s", self.name, text)
        self._error, self._exception = text, exc

    def _ok(self) -> None:
        if self._error is not None:
            log.info("informer %s: connected again", self.name)
        self._error = self._exception = None

    def _list_pages(self) -> tuple[list[dict[str, Any]], str]:
        """The whole collection, page by page; a full list in one answer when a continue token expired."""
        selectors = {"label_selector": self.label_selector, "field_selector": self.field_selector}
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            try:
                page, version, token = self.kube.list_page(self.path, limit=self.page_size,
                                                           continue_token=token or None, **selectors)
            except KubeError as exc:
                if exc.status != 410 or not token:
                    raise
                # The snapshot the pages came from was compacted away: list it whole, from now.
                self.stats.expired_continues += 1
                log.info("informer %s: the list's continue token expired; listing in full", self.name)
                page, version, _ = self.kube.list_page(self.path, **selectors)
                self.stats.pages += 1
                return page, version
            self.stats.pages += 1
            items += page
            if not token:
                return items, version

    def _list(self) -> str:
        items, version = self._list_pages()
        fresh = {object_key(item): item for item in items}
        with self._lock:
            changed = changed_keys(self._items, fresh)
            self._items = fresh
            self._rv = version
        self._progress = False
        self.stats.lists += 1
        self._listed.set()
        self._ok()
        for key in changed:
            self._notify(key)
        return version

    def _opened(self, response: Any) -> None:
        self._response = response
        self.stats.watches += 1
        self._ok()

    def _watch(self, version: str) -> str:
        """Apply events until the server ends the watch; returns the version to resume from."""
        for event in self.kube.watch(self.path, version, timeout_seconds=self.timeout_seconds,
                                     label_selector=self.label_selector, field_selector=self.field_selector,
                                     on_open=self._opened):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise KubeError(int(obj.get("code") or 500), str(obj.get("reason") or "Error"),
                                str(obj.get("message") or ""), f"WATCH {self.path}")
            self._progress = True
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                self._rv = version
                continue
            key = object_key(obj)
            with self._lock:
                if kind == "DELETED":
                    self._items.pop(key, None)
                else:
                    self._items[key] = obj
                self._rv = version
            self.stats.events += 1
            self._notify(key)
            if self._stop.is_set():
                break
        self._response = None
        return version

    def _notify(self, key: str) -> None:
        if self.on_change is not None:
            try:
                self.on_change(key)
            except Exception:  # a listener's bug must not stop the informer
                log.exception("informer %s: change listener failed", self.name)
