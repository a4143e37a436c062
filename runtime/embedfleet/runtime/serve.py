"""`embedfleet serve`: settings -> service -> app -> uvicorn, with a graceful drain on SIGTERM.

Kubernetes sends SIGTERM and keeps routing for a moment; uvicorn alone would close the socket at
once. We first turn /ready false and answer new work with 503, let accepted requests finish
(bounded by --drain-timeout), and only then let uvicorn shut down and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys

import uvicorn

from embedfleet.otel import TracingConfigError, exporters, provider_from_env
from embedfleet.runtime.api.app import create_app
from embedfleet.runtime.api.gate import GateState
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.service import Models
from embedfleet.runtime.settings import RuntimeSettings, add_settings_arguments, settings_or_exit_code
from embedfleet.runtime.tracing import RuntimeTracing

log = logging.getLogger("embedfleet.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gate: GateState, drain_timeout: float) -> None:
        super().__init__(config)
        self.gate = gate
        self.drain_timeout = drain_timeout
        self._drain: asyncio.Task | None = None
        self.failed = False

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and self._drain is None and not self.should_exit:
            self.gate.draining = True
            log.info("SIGTERM: draining %d in-flight requests (up to %.0fs)", self.gate.in_flight,
                     self.drain_timeout)
            self._drain = asyncio.get_event_loop().create_task(self._drain_then_exit())
            return
        super().handle_exit(sig, frame)

    async def _drain_then_exit(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        # a 20 ms poll is simpler than threading an Event through the gate, and costs nothing here
        while self.gate.in_flight > 0 and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        if self.gate.in_flight:
            log.warning("drain timeout: %d requests still in flight", self.gate.in_flight)
        else:
            log.info("drained; shutting down")
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.gate.tracing is not None:  # the spans still buffered go out now: uvicorn ends the process by
            await asyncio.to_thread(self.gate.tracing.shutdown)  # re-raising the signal once this returns


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
    settings = settings_or_exit_code(args, "serve")
    if isinstance(settings, int):
        return settings
    problem = verify_model(settings)
    if problem is not None:
        print(f"embedfleet serve: refusing to load the model: {problem}", file=sys.stderr)
        return 1
    try:
        names = exporters(settings.otel, os.environ)
    except TracingConfigError as exc:
        print(f"embedfleet serve: {exc}", file=sys.stderr)
        return 2
    tracing = RuntimeTracing(provider_from_env("embedfleet-runtime", names)) if names else None
    if tracing is not None:
        log.info("tracing on: %s spans (OTEL_* variables; docs/tracing.md)", ", ".join(names))
    metrics = RuntimeMetrics()
    gate = GateState(tracing=tracing)
    models = Models(settings, metrics)
    config = uvicorn.Config(None, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=settings.log_level == "debug", timeout_graceful_shutdown=settings.drain_timeout,
                            timeout_keep_alive=math.ceil(settings.keep_alive_seconds))
    server = DrainingServer(config, gate, settings.drain_timeout)

    def load_failed() -> None:
        server.failed = True
        server.should_exit = True

    config.app = create_app(models, gate, on_load_failed=load_failed)
    config.loaded = False
    server.run()
    if server.failed:
        print(f"embedfleet serve: model failed to load: {models.load_error}", file=sys.stderr)
        return 1
    return 0
