"""`embedfleet gateway --upstream NAME=URL [--upstream NAME=URL ...]`: the fleet's front door.

NAME is the served model name requests ask for (`model`); repeat a NAME for each replica of that
deployment. `embedfleet gateway --kubernetes [--namespace NS ...]` takes the deployments and their
replicas from the cluster instead (kube.py: EmbeddingDeployments and EndpointSlices, watched), with
the in-cluster identity or $KUBECONFIG, and wakes deployments scaled to zero.

Exit codes: 0 stopped (SIGTERM/SIGINT, after in-flight requests finished), 2 bad flags.
On SIGTERM /ready turns 503 while requests keep being served, and the process exits once none is in
flight (at most --drain-timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import sys

import aiohttp

from embedfleet.calls import CallApp
from embedfleet.gateway.config import (
    BALANCES,
    ConfigError,
    GatewayConfig,
    parse_bounds,
    parse_spill,
    parse_upstreams,
    parse_vector_spaces,
)
from embedfleet.gateway.fleet import Fleet
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.gateway.proxy import Gateway
from embedfleet.gateway.tracing import GatewayTracing, TracingConfigError, exporters, provider_from_env
from embedfleet.gateway.wire import WireClient
from embedfleet.httpserver import add_limit_arguments, limits_from_args, server

log = logging.getLogger("embedfleet.gateway")
KEEPALIVE_S = 4.0  # under uvicorn's 5 s keep-alive, so the gateway closes an idle connection before a replica does
D = GatewayConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", action="append", default=[], metavar="NAME=URL",
                        help="a replica (http://HOST:PORT) of the deployment serving model NAME; repeat for more "
                             "replicas and deployments")
    parser.add_argument("--kubernetes", action="store_true",
                        help="take deployments and replicas from the cluster (EmbeddingDeployments, EndpointSlices) "
                             "and wake deployments at zero through their scale subresource")
    parser.add_argument("--namespace", action="append", default=[], metavar="NS",
                        help="with --kubernetes: watch this namespace (repeat); default: every namespace")
    parser.add_argument("--region", default=D.region,
                        help="this gateway's region: named on requests it spills to another region (metrics, logs)")
    parser.add_argument("--spill", action="append", default=[], metavar="NAME=REGION=URL",
                        help="another region's gateway that deployment NAME may spill to when it has no ready "
                             "replica here, or every replica is over its queue bound (repeat; tried in order). "
                             "On Kubernetes the hub sets this per deployment "
                             "from its placement policy (annotation embedfleet.dev/spill-to)")
    parser.add_argument("--vector-space", action="append", default=[], metavar="NAME=SPACE",
                        help="pin requests for NAME to this vector space (replicas of another are never sent them); "
                             "default: the space of the first routable --upstream listed, from its GET /v1/models. "
                             "On Kubernetes the EmbeddingDeployment's status says it (docs/rollouts.md)")
    parser.add_argument("--bounds", action="append", default=[], metavar="NAME=FIELD=SECONDS[,...]",
                        help="deployment NAME's own shed and spill bounds instead of the flags', named as the "
                             "EmbeddingDeployment fields that set them on Kubernetes: maxQueueSeconds, "
                             "maxQueueSecondsBulk, spillAfterSeconds (e.g. bge=maxQueueSeconds=2,spillAfterSeconds=1)")
    parser.add_argument("--spill-after", type=float, default=D.spill_after,
                        help="spill only when the expected wait here (a cold start, or every saturated replica's "
                             "queue; bulk work only past --max-queue-seconds-bulk) is longer than this many seconds; "
                             "on Kubernetes a deployment's spec.placement.spillAfterSeconds wins "
                             f"(default: {D.spill_after})")
    parser.add_argument("--host", default=D.host, help=f"address to bind (default: {D.host})")
    parser.add_argument("--port", type=int, default=D.port, help=f"port to bind (default: {D.port})")
    parser.add_argument("--poll-interval", type=float, default=D.poll_interval,
                        help=f"seconds between polls of each replica's GET /load (default: {D.poll_interval})")
    parser.add_argument("--held-poll-interval", type=float, default=D.held_poll_interval,
                        help=f"the same while any request is held (default: {D.held_poll_interval})")
    parser.add_argument("--poll-timeout", type=float, default=D.poll_timeout,
                        help=f"a replica whose poll takes longer is down (default: {D.poll_timeout})")
    parser.add_argument("--max-held", type=int, default=D.max_held,
                        help=f"requests held per deployment while no replica is ready; beyond: 503 hold_full "
                             f"(default: {D.max_held})")
    parser.add_argument("--hold-timeout", type=float, default=D.hold_timeout,
                        help=f"seconds a request is held at most; then 503 cold_start (default: {D.hold_timeout})")
    parser.add_argument("--cold-start-default", type=float, default=D.cold_start_default,
                        help="expected cold start (seconds) for Retry-After before one is observed "
                             f"(default: {D.cold_start_default})")
    parser.add_argument("--request-timeout", type=float, default=D.request_timeout,
                        help="the gateway's deadline per request in seconds, sent down as X-Request-Timeout less "
                             "the time held (default: none; a client's X-Request-Timeout is honoured either way)")
    parser.add_argument("--payload-limit", type=int, default=D.payload_limit,
                        help=f"largest request body in bytes; 413 beyond (default: {D.payload_limit})")
    add_limit_arguments(parser, keep_alive_default=D.limits.keep_alive_s)
    parser.add_argument("--max-connections-per-replica", type=int, default=D.max_connections_per_replica,
                        help="keep-alive connections to one replica at most; 0: no limit (default: 0)")
    parser.add_argument("--upstream-dead-after", type=int, default=D.upstream_dead_after,
                        help="whole seconds a replica's host may leave TCP keepalive probes unanswered before "
                             "it is lost: marked down, and the requests waiting on it with no answer byte yet "
                             f"are sent to another replica; 0: never probed (default: {D.upstream_dead_after})")
    parser.add_argument("--drain-timeout", type=float, default=D.drain_timeout,
                        help=f"on SIGTERM, seconds in-flight requests may take to finish (default: {D.drain_timeout})")
    parser.add_argument("--balance", choices=BALANCES, default=D.balance,
                        help="least-wait: the replica with the least expected wait (default). round-robin: in turn, "
                             "blind to load; only a baseline for benchmarks, never for serving")
    parser.add_argument("--max-queue-seconds", type=float, default=D.max_queue_seconds,
                        help="refuse a query at once (429 overloaded, Retry-After) when every replica reports an "
                             "expected wait over this and says it is saturated; 0: never; on Kubernetes a "
                             "deployment's spec.runtime.maxQueueSeconds wins (default: "
                             f"{D.max_queue_seconds}, the runtime's)")
    parser.add_argument("--max-queue-seconds-bulk", type=float, default=D.max_queue_seconds_bulk,
                        help="the same for bulk requests (X-Priority: bulk, or more than --urgent-max-inputs "
                             f"inputs), by reported wait alone (default: {D.max_queue_seconds_bulk}, the runtime's)")
    parser.add_argument("--urgent-max-inputs", type=int, default=D.urgent_max_inputs,
                        help="requests with more inputs are bulk: held behind queries, shed against the bulk bound "
                             f"(default: {D.urgent_max_inputs}, the runtime's)")
    parser.add_argument("--eject-after", type=int, default=D.eject_after,
                        help="a replica failing this many requests in a row (connection refused, 5xx but 503 "
                             f"draining and 504) is not picked for a while; 0: never (default: {D.eject_after})")
    parser.add_argument("--eject-base", type=float, default=D.eject_base,
                        help=f"seconds of a first ejection, doubled while it fails again (default: {D.eject_base})")
    parser.add_argument("--eject-max", type=float, default=D.eject_max,
                        help=f"longest ejection in seconds (default: {D.eject_max})")
    parser.add_argument("--otel", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("EMBEDFLEET_OTEL", "").strip().lower() in ("1", "true", "yes", "on"),
                        help="export OpenTelemetry traces (OTLP/HTTP, set up by the standard OTEL_* variables; also "
                             "on when OTEL_TRACES_EXPORTER names an exporter; env EMBEDFLEET_OTEL): docs/tracing.md")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    upstreams = parse_upstreams(args.upstream)
    if args.kubernetes and upstreams:
        raise ConfigError("--kubernetes takes the replicas from the cluster: drop --upstream")
    if args.namespace and not args.kubernetes:
        raise ConfigError("--namespace is for --kubernetes")
    spill = parse_spill(args.spill)
    if args.kubernetes and spill:
        raise ConfigError("--kubernetes takes spill targets from the hub's annotation: drop --spill")
    unknown = sorted(set(spill) - set(upstreams))
    if unknown:
        raise ConfigError(f"--spill names deployments with no --upstream: {', '.join(unknown)}")
    spaces = parse_vector_spaces(args.vector_space)
    if args.kubernetes and spaces:
        raise ConfigError("--kubernetes takes vector spaces from the EmbeddingDeployments' status: drop --vector-space")
    unknown = sorted(set(spaces) - set(upstreams))
    if unknown:
        raise ConfigError(f"--vector-space names deployments with no --upstream: {', '.join(unknown)}")
    bounds = parse_bounds(args.bounds)
    if args.kubernetes and bounds:
        raise ConfigError("--kubernetes takes each deployment's bounds from its spec (spec.runtime.maxQueueSeconds, "
                          "maxQueueSecondsBulk, spec.placement.spillAfterSeconds): drop --bounds")
    unknown = sorted(set(bounds) - set(upstreams))
    if unknown:
        raise ConfigError(f"--bounds names deployments with no --upstream: {', '.join(unknown)}")
    if not upstreams and not args.kubernetes:
        raise ConfigError("no upstreams: give --upstream NAME=URL (once per replica), or --kubernetes")
    try:
        tracing = exporters(args.otel, os.environ)
    except TracingConfigError as exc:
        raise ConfigError(str(exc)) from None
    return GatewayConfig(
        upstreams=upstreams, host=args.host, port=args.port, poll_interval=args.poll_interval,
        held_poll_interval=args.held_poll_interval, poll_timeout=args.poll_timeout, max_held=args.max_held,
        hold_timeout=args.hold_timeout, cold_start_default=args.cold_start_default,
        request_timeout=args.request_timeout, payload_limit=args.payload_limit, limits=limits_from_args(args),
        max_connections_per_replica=args.max_connections_per_replica, drain_timeout=args.drain_timeout,
        upstream_dead_after=args.upstream_dead_after,
        kubernetes=args.kubernetes, namespaces=tuple(args.namespace), region=args.region, spill=spill,
        vector_spaces=spaces, bounds=bounds,
        spill_after=args.spill_after, balance=args.balance, max_queue_seconds=args.max_queue_seconds,
        max_queue_seconds_bulk=args.max_queue_seconds_bulk, urgent_max_inputs=args.urgent_max_inputs,
        eject_after=args.eject_after, eject_base=args.eject_base, eject_max=args.eject_max, tracing=tracing)


async def serve(config: GatewayConfig) -> int:
    tracing = GatewayTracing(provider_from_env("embedfleet-gateway", config.tracing)) if config.tracing else None
    # aiohttp's client for the polls (GET /load, GET /v1/models) and the gateway's own GET /v1/models to every
    # deployment: a pool of its own, so a poll never waits behind work for a connection. All work goes
    # through the gateway's upstream client (wire.py), which makes its spans itself when tracing is on.
    polls = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                  trace_configs=None if tracing is None else [tracing.client_trace_config()])
    rng = random.Random()
    fleet = Fleet(config, polls, rng)
    wire = WireClient(config.max_connections_per_replica, KEEPALIVE_S, dead_after_s=config.upstream_dead_after)
    gateway = Gateway(config, fleet, GatewayMetrics(fleet.snapshot, fleet.replica_waits), polls, rng, wire)
    # off, no tracing code runs on the proxy path at all
    app = CallApp(gateway.handle if tracing is None else tracing.wrap(gateway.handle), config.payload_limit)
    http = server(app, config.host, config.port, config.limits, graceful_s=config.drain_timeout)
    poller = asyncio.create_task(fleet.upstreams.run(), name="poll")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    source = watch_cluster(config, fleet, gateway, loop) if config.kubernetes else None
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await http.startup()
        log.info("gateway on %s:%d for %s", config.host, config.port,
                 ", ".join(f"{name} ({len(urls)} replicas)" for name, urls in config.upstreams.items())
                 or f"the EmbeddingDeployments of {', '.join(config.namespaces) or 'every namespace'}")
        await stop.wait()
        gateway.draining = True
        deadline = loop.time() + config.drain_timeout
        # a 20 ms poll is simpler than an event threaded through every request, and costs nothing here
        while any(d.in_flight for d in fleet.deployments.values()) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        log.info("stopping")
    finally:
        if source is not None:
            source.stop()
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        if http.started:
            await http.shutdown()
        wire.close()
        await polls.close()
        if tracing is not None:
            tracing.shutdown()
    return 0


def watch_cluster(config: GatewayConfig, fleet: Fleet, gateway: Gateway, loop: asyncio.AbstractEventLoop):
    """Kubernetes mode: the fleet's routes from the cluster's watches; holding wakes a deployment."""
    import kubernetes

    from embedfleet.gateway.kube import KubeSource
    from embedfleet.gateway.spill import parse_annotation

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    def apply_spill(annotations: dict[str, str]) -> None:
        for key in fleet.deployments:
            fleet.set_spill(key, parse_annotation(annotations.get(key)))

    restarts = gateway.metrics.watch_restarts
    source = KubeSource(kubernetes.client.ApiClient(), config.namespaces, fleet.set_routes, loop, apply_spill,
                        on_restart=lambda kind: restarts.labels(kind=kind).inc())
    fleet.on_hold = lambda deployment: loop.create_task(source.wake(deployment.name))
    gateway.synced = source.synced.is_set
    source.start()
    return source


def _event_loop_factory():
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"embedfleet gateway: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        return runner.run(serve(config))
