"""`embedfleet worker`: a standalone async worker (no HTTP API) that loads the model and consumes jobs.

It takes the same settings as `embedfleet serve` (model, device, batch limits, Redis, webhooks), so
a worker Deployment is the runtime's config plus a different command. SIGTERM stops taking jobs,
lets running ones finish (up to --drain-timeout) and exits 0; what is left stays pending in Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from prometheus_client import start_http_server

from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.settings import RuntimeSettings, add_settings_arguments, settings_or_exit_code

log = logging.getLogger("embedfleet.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default=None, help="consumer name in the Redis group (default: host-pid)")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on --host:PORT (default 0: off)")
    add_settings_arguments(parser, RuntimeSettings)


async def _main(settings: RuntimeSettings, metrics: RuntimeMetrics, name: str | None) -> int:
    from embedfleet.runtime.asyncq.runner import AsyncRuntime
    from embedfleet.runtime.service import Models

    models = Models(settings, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await models.load()
    except Exception:
        print(f"embedfleet worker: model failed to load: {models.load_error}", file=sys.stderr)
        return 1
    runtime = AsyncRuntime(models, run_worker=True, name=name)
    await runtime.start()
    log.info("worker %s consuming jobs from %s", runtime.name, settings.redis_url.split("@")[-1])
    await stop.wait()
    log.info("stopping: letting running jobs finish (up to %.0fs)", settings.drain_timeout)
    await runtime.stop()
    await models.close()
    return 0


def run(args: argparse.Namespace) -> int:
    settings = settings_or_exit_code(args, "worker")
    if isinstance(settings, int):
        return settings
    if not settings.redis_url:
        print("embedfleet worker: --redis-url (or EMBEDFLEET_REDIS_URL) is required", file=sys.stderr)
        return 2
    metrics = RuntimeMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=settings.host, registry=metrics.registry)
    return asyncio.run(_main(settings, metrics, args.name))
