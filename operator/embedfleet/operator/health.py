"""The operator process's health endpoints for the kubelet: ``/healthz`` (liveness) and ``/readyz``
(readiness), in controller-runtime's model.

They are served by aiohttp on a thread of their own from the moment the process starts, whatever the
process is doing: loading its handlers, waiting for the leader Lease as a standby, or running kopf. So a
standby is never killed for having no endpoint, and ``kubectl rollout status`` / ``helm install --wait``
wait for a replica that can do its job.

* Liveness: the process is not wedged. The server answers, and once kopf runs, kopf's event loop runs a
  no-op within ``LOOP_TIMEOUT_S``. It never depends on the API server: restarting the pod would not bring
  an unreachable API server back.
* Readiness: the process can reconcile now (the leader) or take over the moment it holds the Lease (a
  standby). The role's handlers are loaded; the API server answers and serves the custom resources the
  role works on; and where this replica acts, kopf has run its startup handlers.

Each answer is JSON, ``{"status": "ok" | "failed", "checks": {name: "ok" | reason}}``; a failure is 503.
A check is a plain function returning None (passes) or the reason it fails; it runs in a worker thread
and fails when it takes longer than ``CHECK_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

#: A check: None when it passes, else why it fails (a short sentence for the probe's answer and events).
Check = Callable[[], str | None]

LIVE_PATH = "/healthz"
READY_PATH = "/readyz"
#: The kubelet's probes time out after a few seconds (the chart: 5); a check answers well before that.
CHECK_TIMEOUT_S = 4.0
#: kopf's event loop must run a no-op within this long to count as alive.
LOOP_TIMEOUT_S = 3.0
#: How long one answer of the API server (discovery) is reused: probes of several paths and replicas'
#: probes every few seconds cost at most one request per this many seconds.
API_CACHE_S = 5.0


def parse_endpoint(url: str) -> tuple[str, int, str]:
    """``http://HOST:PORT/PATH`` -> (host, port, liveness path)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.port is None:
        raise ValueError(f"a health endpoint is http://HOST:PORT/PATH, got {url!r}")
    return parts.hostname or "0.0.0.0", parts.port, parts.path or LIVE_PATH


class HealthServer:
    """``live_path`` and ``ready_path`` answering from the given checks, on a daemon thread's own loop."""

    def __init__(self, host: str, port: int, *, live: Mapping[str, Check], ready: Mapping[str, Check],
                 live_path: str = LIVE_PATH, ready_path: str = READY_PATH) -> None:
        if live_path == ready_path:
            raise ValueError(f"liveness and readiness need paths of their own, got {live_path!r} for both")
        self.host, self.port = host, port
        self.live, self.ready = dict(live), dict(ready)
        self.live_path, self.ready_path = live_path, ready_path
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Checks may block (an HTTP request): they run here, never on the server's loop.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health-check")

    def start(self) -> HealthServer:
        """Bind and serve; returns once the port is bound (raises OSError when it cannot be)."""
        bound: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(bound,), name="health-server", daemon=True)
        self._thread.start()
        bound.result(timeout=30)
        log.info("health: liveness at http://%s:%d%s, readiness at %s", self.host, self.port, self.live_path,
                 self.ready_path)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _serve(self, bound: concurrent.futures.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        app = web.Application()
        app.add_routes([web.get(self.live_path, self._answer(self.live)),
                        web.get(self.ready_path, self._answer(self.ready))])
        # No access log: the kubelet asks every few seconds.
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, self.host, self.port).start())
        except BaseException as exc:
            bound.set_exception(exc)
            loop.close()
            return
        bound.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def _answer(self, checks: Mapping[str, Check]) -> Callable[[web.Request], Any]:
        async def handle(_: web.Request) -> web.Response:
            results = await asyncio.gather(*(self._run(check) for check in checks.values()))
            failed = {name: why for name, why in zip(checks, results, strict=True) if why is not None}
            body = {"status": "failed" if failed else "ok",
                    "checks": {name: failed.get(name, "ok") for name in checks}}
            return web.json_response(body, status=503 if failed else 200)

        return handle

    async def _run(self, check: Check) -> str | None:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, check), CHECK_TIMEOUT_S)
        except TimeoutError:
            return f"no answer within {CHECK_TIMEOUT_S:g}s"
        except Exception as exc:  # a check that raises fails; the probe still answers
            return f"{type(exc).__name__}: {exc}"


def loop_responsive(loop: asyncio.AbstractEventLoop, timeout: float = LOOP_TIMEOUT_S) -> str | None:
    """Whether ``loop`` (running in another thread) runs a callback within ``timeout`` seconds."""
    done = threading.Event()
    try:
        loop.call_soon_threadsafe(done.set)
    except RuntimeError:  # closed: the operator is stopping
        return None
    if done.wait(timeout):
        return None
    return f"kopf's event loop ran nothing for {timeout:g}s (blocked)"


class ServedResources:
    """Whether the API server answers and serves ``plurals`` of ``group``/``version``: one discovery GET
    through the official client (``client()`` makes its ApiClient, on first use), its answer reused for
    ``cache_s`` seconds."""

    def __init__(self, client: Callable[[], Any], group: str, version: str, plurals: Sequence[str],
                 cache_s: float = API_CACHE_S, timeout: tuple[float, float] = (2.0, 3.0)) -> None:
        self.group, self.version, self.plurals = group, version, tuple(plurals)
        self.cache_s, self.timeout = cache_s, timeout
        self._client = client
        self._api: Any = None
        self._lock = threading.Lock()
        self._last: tuple[float, str | None] | None = None

    def __call__(self) -> str | None:
        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < self.cache_s:
                return self._last[1]
            why = self._ask()
            self._last = (time.monotonic(), why)
            return why

    def _ask(self) -> str | None:
        import kubernetes

        what = f"{self.group}/{self.version}"
        try:
            if self._api is None:
                self._api = kubernetes.client.CustomObjectsApi(self._client())
            found = self._api.get_api_resources(self.group, self.version, _request_timeout=self.timeout)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return f"the API server serves no {what}: install the chart's CRDs"
            return f"the API server refused discovery of {what}: {exc.status} {exc.reason}"
        except Exception as exc:  # unreachable, TLS, credentials: all mean "cannot reconcile"
            return f"the API server is unreachable: {type(exc).__name__}: {exc}"[:500]
        served = {r.name for r in found.resources or []}
        missing = [p for p in self.plurals if p not in served]
        if missing:
            return f"the API server does not serve {', '.join(missing)} ({what}): install the chart's CRDs"
        return None
