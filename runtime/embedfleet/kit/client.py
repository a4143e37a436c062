"""Raw Kubernetes API calls by URL over the official ``kubernetes`` client: one request path, collections
listed with their resourceVersion, and watches streamed line by line.

Callers address collections by URL (``/apis/GROUP/VERSION/[namespaces/NS/]PLURAL``) instead of one typed API
per kind, so an informer or an apply works the same for any kind, custom resources included. Errors are
:class:`KubeError` with the server's status and body, and :func:`describe` turns any failure of a call into
one short stable sentence (the same failure reads the same every time: no object addresses in it).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import urllib3

#: (connect, read) seconds of every call but watches.
TIMEOUT = (5.0, 30.0)


class KubeError(Exception):
    def __init__(self, status: int, reason: str, body: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status} {reason}: {body[:500]}")
        self.status = status
        self.reason = reason
        self.body = body


def describe(exc: BaseException) -> str:
    """A short, stable sentence for a failed call."""
    if isinstance(exc, KubeError):
        try:
            message = json.loads(exc.body).get("message") or exc.body
        except (ValueError, AttributeError):
            message = exc.body
        text = f"HTTP {exc.status} {exc.reason}: {message}"
        if exc.status == 409 and "already exists" in str(message):
            text += " (not created by the hub: remove or rename it on the spoke)"
    elif isinstance(exc, urllib3.exceptions.MaxRetryError):
        text = f"API server unreachable: {exc.reason}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return re.sub(r"<[^<>]* object at 0x[0-9a-f]+>:?\s*", "", text)[:400]


class KubeClient:
    """Requests, lists and watches by URL on one ``kubernetes.client.ApiClient`` (made on first use by
    ``factory`` when none is given: credentials are then read only when a call needs them)."""

    def __init__(self, api_client: kubernetes.client.ApiClient | None = None,
                 timeout: tuple[float, float] = TIMEOUT,
                 factory: Callable[[], kubernetes.client.ApiClient] | None = None) -> None:
        self._client = api_client
        self._factory = factory
        #: (connect, read) seconds for every request but watches.
        self.timeout = timeout
        self._client_lock = threading.Lock()

    @property
    def client(self) -> kubernetes.client.ApiClient:
        with self._client_lock:
            if self._client is None:
                if self._factory is None:
                    raise RuntimeError("KubeClient: no API client and no factory to make one")
                self._client = self._factory()
            return self._client

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        allow_404: bool = False,
        accept: str = "application/json",
        timeout: float | tuple[float, float] | None = None,
    ) -> Any:
        """The decoded JSON answer (``{}`` when empty; None for a 404 when ``allow_404``). ``timeout``
        replaces the client's (connect, read) pair for this call; one number is urllib3's ``total``: it bounds
        the connect and the read, but not the host name's lookup (``getaddrinfo`` has no time-out, and
        bounding it would need a thread per call), nor a server that trickles its answer a little at a time
        (each read gets the time that was left when reading began). A caller whose bound is a promise (the
        leader's renewal) keeps a watchdog of its own for the call that overruns."""
        headers = {"Accept": accept, "Content-Type": content_type}
        method_, url, headers, body_, post = self.client.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"])
        response = self.client.call_api(
            method_, url, header_params=headers, body=body_, post_params=post,
            _request_timeout=self.timeout if timeout is None else timeout,
        )
        data = response.read()
        if response.status == 404 and allow_404:
            return None
        if response.status >= 400:
            raise KubeError(
                response.status, str(response.reason), data.decode("utf-8", "replace"), f"{method} {path}"
            )
        return json.loads(data) if data else {}

    def list_raw(
        self, path: str, *, label_selector: str | None = None, field_selector: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """(items, the list's resourceVersion) of a collection URL: what an informer starts a watch from."""
        items, version, _ = self.list_page(path, label_selector=label_selector, field_selector=field_selector)
        return items, version

    def list_page(
        self, path: str, *, label_selector: str | None = None, field_selector: str | None = None,
        limit: int | None = None, continue_token: str | None = None,
    ) -> tuple[list[dict[str, Any]], str, str]:
        """One page of a collection: (items, the list's resourceVersion, the token of the next page or "").
        Without ``limit`` the whole collection comes in one page. An expired token is a 410 `KubeError`."""
        query = [(k, v) for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v]
        if limit:
            query.append(("limit", str(limit)))
        if continue_token:
            query.append(("continue", continue_token))
        data = self.request("GET", path, query=query) or {}
        meta = data.get("metadata") or {}
        return (list(data.get("items") or []), str(meta.get("resourceVersion") or ""),
                str(meta.get("continue") or ""))

    def watch(
        self, path: str, resource_version: str, *, timeout_seconds: int = 300, label_selector: str | None = None,
        field_selector: str | None = None, on_open: Any = None,
    ) -> Iterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) of a collection URL from ``resource_version``, with
        bookmarks, until the server ends the watch (``timeout_seconds``) or the connection breaks.

        ``on_open`` receives the streaming response, so another thread can close it to stop the watch at
        once. An ``ERROR`` event (410 Gone: the version is too old) is yielded like any other. The read
        time-out (``timeout_seconds`` plus the connect time-out) ends a watch whose server went silent."""
        query = [("watch", "true"), ("resourceVersion", resource_version), ("allowWatchBookmarks", "true"),
                 ("timeoutSeconds", str(timeout_seconds))]
        query += [(k, v) for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v]
        headers = {"Accept": "application/json"}
        method, url, headers, body, post = self.client.param_serialize(
            "GET", path, query_params=query, header_params=headers, auth_settings=["BearerToken"])
        response = self.client.call_api(method, url, header_params=headers, body=body, post_params=post,
                                        _request_timeout=(self.timeout[0], timeout_seconds + self.timeout[0]))
        if response.status >= 400:
            raise KubeError(response.status, str(response.reason), response.read().decode("utf-8", "replace"),
                            f"WATCH {path}")
        raw = response.response
        if on_open is not None:
            on_open(raw)
        try:
            pending = b""
            for chunk in raw.stream(65536, decode_content=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        finally:
            raw.release_conn()


def without_retries(api_client: kubernetes.client.ApiClient) -> kubernetes.client.ApiClient:
    """A client on the same server and credentials whose calls are never retried by urllib3 (by default
    it retries a failed connection or read up to three times, each with a fresh time-out): for calls
    whose time bound is a promise, such as a leader's renewal."""
    config = copy.deepcopy(api_client.configuration)
    config.retries = False
    config.client_go_retries = False
    client = kubernetes.client.ApiClient(configuration=config)
    client.user_agent = api_client.user_agent
    return client


def collection_path(api_version: str, plural: str, namespace: str | None = None) -> str:
    """The URL of a collection: all namespaces when ``namespace`` is None."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace is not None:
        base += f"/namespaces/{namespace}"
    return f"{base}/{plural}"
