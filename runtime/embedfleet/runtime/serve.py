"""`embedfleet serve`: settings -> service -> app -> the HTTP server, with a graceful drain on SIGTERM.

The ASGI application (api/app.py) is served by uvicorn with the bounds of httpserver.py (head size and
timeouts, pipelining, body stalls); the request body limit is the application's gate's (api/gate.py).

Kubernetes sends SIGTERM and keeps routing for a moment; closing the socket at once would fail
requests still being routed here. We first turn /ready false and answer new work with 503, let
accepted requests finish (bounded by --drain-timeout), and only then stop listening and exit 0.
SIGINT stops at once, still letting requests in flight finish within --drain-timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING

# Only what parsing and checking the flags needs is imported here: a refused configuration exits in a fraction
# of a second instead of after torch, the engines and the web stack (imported in `run`, once the settings hold).
from embedfleet.runtime.settings import RuntimeSettings, add_settings_arguments, settings_or_exit_code
from embedfleet.runtime.startgc import hold, release

if TYPE_CHECKING:
    from embedfleet.runtime.api.gate import GateState
    from embedfleet.runtime.metrics import RuntimeMetrics
    from embedfleet.runtime.split.roles import Role

log = logging.getLogger("embedfleet.serve")


class Server:
    """The application on the HTTP server, with a graceful drain on SIGTERM and a clean stop on SIGINT."""

    def __init__(self, app, settings: RuntimeSettings, gate: GateState, metrics: RuntimeMetrics,
                 role: Role | None = None, sockets: list[socket.socket] | None = None) -> None:
        self.app = app
        self.role = role  # split serving (split/): where this process listens, and the engine's link
        self.sockets = sockets  # a standby parent's listening socket (standby.py); None: bind host:port
        self.settings = settings
        self.gate = gate
        self.metrics = metrics
        self.stop = asyncio.Event()
        self.failed = False
        self._drain: asyncio.Task | None = None

    def load_failed(self) -> None:
        self.failed = True
        self.stop.set()

    def on_sigterm(self) -> None:
        if self._drain is not None or self.stop.is_set():
            return
        self.gate.draining = True
        log.info("SIGTERM: draining %d in-flight requests (up to %.0fs)", self.gate.in_flight,
                 self.settings.drain_timeout)
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_timeout
        # a 20 ms poll is simpler than threading an Event through the gate, and costs nothing here
        while self.gate.in_flight > 0 and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if self.gate.in_flight:
            log.warning("drain timeout: %d requests still in flight", self.gate.in_flight)
        else:
            log.info("drained; shutting down")
        self.stop.set()

    async def serve(self) -> None:
        from embedfleet.httpserver import Limits, bound_port, server
        from embedfleet.runtime.lifespan import Lifespan

        s = self.settings
        lifespan = Lifespan(self.app)
        await lifespan.startup()
        limits = Limits(head_timeout_s=s.head_timeout_seconds, head_total_s=s.head_total_seconds,
                        body_timeout_s=s.body_timeout_seconds, keep_alive_s=s.keep_alive_seconds,
                        max_headers=s.max_headers, max_connections=s.max_connections,
                        min_body_rate=s.min_body_rate)
        role = self.role
        http = server(self.app, s.host, s.port, limits, graceful_s=s.drain_timeout,
                      uds=role.uds if role is not None else None)
        loop = asyncio.get_running_loop()
        try:
            await http.startup(sockets=role.sockets if role is not None else self.sockets)
            if role is None:
                if self.sockets is None:
                    log.info("listening on http://%s:%d", s.host, bound_port(http))
            elif role.link is not None:
                await role.link.start()
            loop.add_signal_handler(signal.SIGTERM, self.on_sigterm)
            loop.add_signal_handler(signal.SIGINT, self.stop.set)
            await self.stop.wait()
        finally:
            # Accepted requests finish (bounded by --drain-timeout); new connections are refused from here.
            if role is not None and role.link is not None:
                await role.link.stop()
            if http.started:
                await http.shutdown()
            if self.gate.tracing is not None:  # the spans still buffered go out now
                await asyncio.to_thread(self.gate.tracing.shutdown)
            await lifespan.shutdown()


def run_loop(main: Coroutine) -> None:
    """On uvloop where installed (it is with the runtime's dependencies), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, RuntimeSettings)


def verify_model(settings: RuntimeSettings) -> str | None:
    """With --model-digest: check the model directory is the verified cache entry of that digest before
    anything is loaded from it (a weight file changed on the node, a half-copied or mixed-up entry);
    returns the problem, or None when it matches. Costs one read of the weights."""
    if not settings.model_digest:
        return None
    from embedfleet.operator.cache.digest import VerifyError, verify_entry  # stdlib only; no operator deps

    path = settings.models()[0].path
    try:
        strength = verify_entry(path, settings.model_digest)
    except (VerifyError, OSError) as exc:
        return str(exc)
    log.info("model %s verified against %s (%s)", path, settings.model_digest, strength)
    return None


def run(args: argparse.Namespace) -> int:
    hold()  # rare collections while the server starts; the app's lifespan releases it once ready (startgc.py)
    try:
        return _run(args)
    finally:
        release()


def _run(args: argparse.Namespace) -> int:
    settings = settings_or_exit_code(args, "serve")
    if isinstance(settings, int):
        return settings
    role_name = os.environ.get("_EMBEDFLEET_SPLIT_ROLE")
    fronts = settings.front_processes()
    if settings.engines > 1 and not fronts:
        print(f"embedfleet serve: --engines {settings.engines} needs split serving, and this server is one process "
              f"({'--fronts 0' if settings.fronts == 0 else '--fronts auto chose one on this machine'}); "
              "set --fronts N as well", file=sys.stderr)
        return 2
    if role_name is None:
        from embedfleet.runtime.cpus import summary

        engines = "one engine process" if settings.engines == 1 else f"{settings.engines} engine processes"
        log.info("sizing by %s: %s", summary(), f"{fronts} fronts and {engines}" if fronts
                 else "one process (--fronts 0)" if settings.fronts == 0 else "one process (--fronts auto)")
    if fronts and role_name is None:  # split serving: this process supervises the engine and the fronts
        from embedfleet.runtime.split.supervisor import run as supervise

        if settings.standby:
            log.info("--standby: the split's supervisor already replaces an engine that dies; not used")
        release()  # the supervisor starts nothing itself and lives as long as the pod: usual thresholds
        return supervise(settings, list(getattr(args, "argv", sys.argv[2:])), fronts)
    if settings.standby and role_name is None:  # a parent that imports once and replaces a server that dies
        from embedfleet.runtime.standby import run as standby

        return standby(settings, lambda sock: serve_once(settings, None, fronts, [sock]))
    return serve_once(settings, role_name, fronts)


def serve_once(settings: RuntimeSettings, role_name: str | None, fronts: int,
               sockets: list[socket.socket] | None = None) -> int:
    """One server process: verify the model, build the application, serve until stopped."""
    if role_name == "front":  # the engine verified the model; a front reads only its config and tokenizer
        from embedfleet.runtime.split.roles import front_settings

        settings = front_settings(settings, fronts)
    verifying = time.perf_counter()
    problem = verify_model(settings) if role_name != "front" else None
    verify_s = time.perf_counter() - verifying if settings.model_digest else None
    if problem is not None:
        print(f"embedfleet serve: refusing to load the model: {problem}", file=sys.stderr)
        return 1
    from embedfleet.otel import TracingConfigError, exporters, provider_from_env
    from embedfleet.runtime.api.app import create_app
    from embedfleet.runtime.api.gate import GateState
    from embedfleet.runtime.metrics import RuntimeMetrics
    from embedfleet.runtime.service import Models
    from embedfleet.runtime.tracing import RuntimeTracing

    try:
        names = exporters(settings.otel, os.environ)
    except TracingConfigError as exc:
        print(f"embedfleet serve: {exc}", file=sys.stderr)
        return 2
    tracing = RuntimeTracing(provider_from_env("embedfleet-runtime", names)) if names else None
    if tracing is not None:
        log.info("tracing on: %s spans (OTEL_* variables; docs/tracing.md)", ", ".join(names))
    metrics = RuntimeMetrics()
    if verify_s is not None:
        metrics.cold_start.weights_verified(verify_s)
    gate = GateState(tracing=tracing)
    if role_name is not None:
        from embedfleet.runtime.split.roles import build

        models, server = build(role_name, settings, gate, metrics, Server)
    else:
        models = Models(settings, metrics)
        server = Server(None, settings, gate, metrics, sockets=sockets)
        server.app = create_app(models, gate, on_load_failed=server.load_failed)
    run_loop(server.serve())
    if server.failed:
        print(f"embedfleet serve: model failed to load: {models.load_error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """`python -m embedfleet.runtime.serve FLAGS`: how a split server's supervisor starts its engine and fronts
    (the same flags as `embedfleet serve`)."""
    parser = argparse.ArgumentParser(prog="embedfleet serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
