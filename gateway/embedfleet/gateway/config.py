"""The gateway's settings: one frozen object, built from the flags and checked before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from embedfleet.gateway.coldstart import DEFAULT_COLD_START_S
from embedfleet.gateway.wire import DEAD_AFTER_S
from embedfleet.httpserver import Limits

BALANCES = ("least-wait", "round-robin")


class ConfigError(ValueError):
    """A bad setting; the message names the flag."""


@dataclass(frozen=True)
class GatewayConfig:
    upstreams: dict[str, list[str]] = field(default_factory=dict)  # deployment (served model name) -> replica URLs
    host: str = "0.0.0.0"
    port: int = 8000
    poll_interval: float = 0.5  # seconds between polls of every replica's GET /load
    held_poll_interval: float = 0.05  # the same while any request is held: a cold start ends within this of ready
    poll_timeout: float = 2.0  # a poll slower than this marks the replica down
    max_held: int = 256  # held requests per deployment; beyond: 503 hold_full
    hold_timeout: float = 60.0  # longest a request is held; then 503 cold_start
    cold_start_default: float = DEFAULT_COLD_START_S  # expected cold start before one is observed
    request_timeout: float | None = None  # the gateway's own deadline per request (sent down reduced)
    payload_limit: int = 2_000_000  # bytes; 413 beyond
    limits: Limits = field(default_factory=lambda: Limits(keep_alive_s=75.0))  # the client connections' bounds
    max_connections_per_replica: int = 0  # 0: no limit
    upstream_dead_after: int = DEAD_AFTER_S  # seconds of TCP silence that lose a replica (wire.py); 0: never
    drain_timeout: float = 30.0  # on SIGTERM: how long in-flight (and held) requests may finish
    region: str = ""  # this gateway's region: named on the requests it spills, and in metrics
    spill: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # deployment -> [(region, gateway URL)]
    vector_spaces: dict[str, str] = field(default_factory=dict)  # deployment -> the space it pins (pinning.py)
    # static mode: deployment -> its own bounds by spec field name (--bounds; bounds.py), as on Kubernetes
    bounds: dict[str, dict[str, float]] = field(default_factory=dict)
    spill_after: float = 2.0  # spill when the expected wait here (cold start or queue) is longer (seconds)
    balance: str = "least-wait"  # or "round-robin": a baseline for benchmarks only
    max_queue_seconds: float = 5.0  # shed (429) a query when every replica's expected wait is over it; 0: never
    # (on Kubernetes a deployment's spec.runtime.maxQueueSeconds[Bulk] / spec.placement.spillAfterSeconds win)
    max_queue_seconds_bulk: float = 30.0  # the same for bulk requests
    urgent_max_inputs: int = 4  # requests with more inputs are bulk (the runtime's --urgent-max-inputs)
    eject_after: int = 5  # failures in a row that eject a replica for a while; 0: never
    eject_base: float = 5.0  # seconds of the first ejection (doubling while it keeps failing)
    eject_max: float = 60.0  # longest ejection
    kubernetes: bool = False  # replicas from the cluster (kube.py) instead of `upstreams`
    namespaces: tuple[str, ...] = ()  # Kubernetes mode: watch these; empty: every namespace
    tracing: tuple[str, ...] = ()  # span exporters, from --otel and OTEL_TRACES_EXPORTER (tracing.py); (): off

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be 1..65535, not {self.port}")
        for flag, value in (("--poll-interval", self.poll_interval), ("--held-poll-interval", self.held_poll_interval),
                            ("--poll-timeout", self.poll_timeout), ("--hold-timeout", self.hold_timeout),
                            ("--eject-base", self.eject_base), ("--eject-max", self.eject_max),
                            ("--head-timeout-seconds", self.limits.head_timeout_s),
                            ("--head-total-seconds", self.limits.head_total_s),
                            ("--body-timeout-seconds", self.limits.body_timeout_s),
                            ("--keep-alive-seconds", self.limits.keep_alive_s)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a positive number of seconds, not {value}")
        if self.balance not in BALANCES:
            raise ConfigError(f"--balance must be one of {', '.join(BALANCES)}, not {self.balance!r}")
        for flag, value in (("--cold-start-default", self.cold_start_default),
                            ("--max-queue-seconds", self.max_queue_seconds),
                            ("--max-queue-seconds-bulk", self.max_queue_seconds_bulk),
                            ("--drain-timeout", self.drain_timeout), ("--spill-after", self.spill_after)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{flag} must be >= 0 seconds, not {value}")
        if self.request_timeout is not None and not (math.isfinite(self.request_timeout) and self.request_timeout > 0):
            raise ConfigError(f"--request-timeout must be a positive number of seconds, not {self.request_timeout}")
        for flag, value in (("--max-held", self.max_held),
                            ("--max-connections-per-replica", self.max_connections_per_replica),
                            ("--urgent-max-inputs", self.urgent_max_inputs), ("--eject-after", self.eject_after)):
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0, not {value}")
        if self.upstream_dead_after != 0 and not 2 <= self.upstream_dead_after <= 120:
            raise ConfigError("--upstream-dead-after must be 0 (never) or 2..120 whole seconds, "
                              f"not {self.upstream_dead_after}")
        if self.eject_max < self.eject_base:
            raise ConfigError(f"--eject-max ({self.eject_max}) must be >= --eject-base ({self.eject_base})")
        if self.payload_limit < 1:
            raise ConfigError(f"--payload-limit must be >= 1 byte, not {self.payload_limit}")
        for flag, value in (("--max-headers", self.limits.max_headers),
                            ("--max-connections", self.limits.max_connections),
                            ("--min-body-rate", self.limits.min_body_rate)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a positive number, not {value}")


def parse_spill(values: list[str]) -> dict[str, list[tuple[str, str]]]:
    """["NAME=REGION=URL", ...] -> {NAME: [(REGION, URL), ...]} in the order given (the order tried)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for value in values:
        name, _, rest = value.partition("=")
        region, _, url = rest.partition("=")
        parts = urlsplit(url.strip())
        if not name.strip() or not region.strip() or parts.scheme not in ("http", "https") or not parts.hostname \
                or parts.path not in ("", "/"):
            raise ConfigError(f"--spill {value!r}: expected NAME=REGION=URL (another region's gateway, "
                              "http(s)://HOST[:PORT])")
        out.setdefault(name.strip(), []).append((region.strip(), url.strip().rstrip("/")))
    return out


BOUND_FIELDS = {"maxQueueSeconds": False, "maxQueueSecondsBulk": False, "spillAfterSeconds": True}  # -> 0 allowed


def parse_bounds(values: list[str]) -> dict[str, dict[str, float]]:
    """["NAME=FIELD=SECONDS[,FIELD=SECONDS...]", ...] -> {NAME: {FIELD: SECONDS}}: a deployment's own shed
    and spill bounds in static mode, named as the EmbeddingDeployment fields that set them on Kubernetes
    (maxQueueSeconds and maxQueueSecondsBulk > 0, spillAfterSeconds >= 0, as the CRD allows)."""
    out: dict[str, dict[str, float]] = {}
    for value in values:
        name, _, rest = (part.strip() for part in value.partition("="))
        fields: dict[str, float] = {}
        for item in rest.split(",") if rest else []:
            key, sep, raw = (part.strip() for part in item.partition("="))
            try:
                seconds = float(raw)
            except ValueError:
                seconds = math.nan
            if not sep or key not in BOUND_FIELDS or not math.isfinite(seconds) or seconds < 0 \
                    or (seconds == 0 and not BOUND_FIELDS[key]):
                raise ConfigError(f"--bounds {value!r}: {item!r} is not FIELD=SECONDS with FIELD one of "
                                  f"{', '.join(BOUND_FIELDS)} (maxQueueSeconds* > 0, spillAfterSeconds >= 0)")
            fields[key] = seconds
        if not name or not fields:
            raise ConfigError(f"--bounds {value!r}: expected NAME=FIELD=SECONDS[,FIELD=SECONDS...], e.g. "
                              "bge=maxQueueSeconds=2,spillAfterSeconds=1")
        out.setdefault(name, {}).update(fields)
    return out


def parse_vector_spaces(values: list[str]) -> dict[str, str]:
    """["NAME=SPACE", ...] -> {NAME: SPACE}: the vector space requests for NAME are pinned to, declared
    (as the cluster's status declares it on Kubernetes) instead of learned from the replicas."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, space = (part.strip() for part in value.partition("="))
        if not sep or not name or not space or "," in space:
            raise ConfigError(f"--vector-space {value!r}: expected NAME=SPACE (a served model name and one space)")
        out[name] = space
    return out


def parse_upstreams(values: list[str]) -> dict[str, list[str]]:
    """["NAME=URL", ...] -> {NAME: [URL, ...]} in the order given; a NAME repeated adds replicas."""
    out: dict[str, list[str]] = {}
    for value in values:
        name, sep, url = value.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        parts = urlsplit(url)
        if not sep or not name:
            raise ConfigError(f"--upstream {value!r}: expected NAME=URL (NAME: the served model name)")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
            raise ConfigError(f"--upstream {value!r}: the URL must be http(s)://HOST[:PORT], without a path")
        if url not in out.setdefault(name, []):
            out[name].append(url)
    return out
