"""Where the autoscaler's numbers come from: Prometheus, or the runtime pods' own /metrics.

Two sources, one answer: the total of ``embedfleet_requests_in_flight`` over one deployment's pods.

* Prometheus (``prometheus-api-client``), when a URL is configured: one PromQL query, by default
  ``sum(embedfleet_requests_in_flight{namespace="$namespace",service="$service"})`` — the labels the
  Prometheus Kubernetes service discovery (and a ServiceMonitor) attach. ``$namespace``, ``$name`` and
  ``$service`` are substituted (PromQL never uses ``$``, so no escaping is needed).
* Direct scraping, when not: GET ``http://<podIP>:<port>/metrics`` of every Ready pod concurrently
  (httpx) and parse the exposition text with prometheus_client's own parser. Each pod's body is
  streamed under a byte cap (`DEFAULT_MAX_BODY_BYTES`) and the whole request — connect, headers, body —
  under one deadline, so a pod that sends a huge body or drips bytes cannot hold the tick or the
  operator's memory. Every pod gets its own `PodReading`, answered or failed with a reason; how a failed
  pod still counts towards the total is decided in stale.py, not here.

A source that cannot answer returns ``None`` rather than 0, so a broken scrape never reads as an idle
fleet and never scales anything down.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from string import Template
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

IN_FLIGHT_METRIC = "embedfleet_requests_in_flight"
ASYNC_DEPTH_METRIC = "embedfleet_async_queue_depth"
#: The runtime's periodic probe re-check (docs/rollouts.md, "Drift monitoring"), read from the same scrape.
PROBE_COSINE_METRIC = "embedfleet_probe_cosine"
PROBE_ORDER_METRIC = "embedfleet_probe_order_kept"
#: The engine's own work, read from the same scrape (spoke/throughput.py turns their deltas into embeddings per
#: busy second, which the spoke's heartbeat reports to the hub's cost ranking). Counters: summed over models.
INPUTS_METRIC = "embedfleet_inputs_total"
BUSY_METRIC = "embedfleet_engine_busy_seconds_total"
DEFAULT_QUERY = 'sum(embedfleet_requests_in_flight{namespace="$namespace",service="$service"})'
# Every replica reports the whole Redis queue, so the fleet's backlog is the max, not the sum.
ASYNC_DEPTH_QUERY = 'max(embedfleet_async_queue_depth{namespace="$namespace",service="$service"})'
# Per pod, the worst model's figure (a pod drifts when any of its models does).
PROBE_COSINE_QUERY = 'min by (pod) (embedfleet_probe_cosine{namespace="$namespace",service="$service"})'
PROBE_ORDER_QUERY = 'min by (pod) (embedfleet_probe_order_kept{namespace="$namespace",service="$service"})'


@dataclass(frozen=True)
class Target:
    pod: str
    url: str


#: Largest /metrics body read from one pod. A runtime's exposition is a few KiB; anything near this is
#: a misbehaving pod (or not our runtime at all), and reading it whole would cost the operator memory.
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: Deadline for one pod's whole scrape (connect, headers and every body byte). httpx's own timeout is
#: per operation, so a server dripping a byte a second would never trip it; this one bounds the tick.
DEFAULT_SCRAPE_DEADLINE_S = 2.0


@dataclass(frozen=True)
class PodReading:
    """One pod's answer this tick: its in-flight gauge, or the reason there is none."""

    pod: str
    in_flight: float | None
    async_depth: float | None = None
    error: str | None = None
    #: The probe re-check's lowest cosine and order (1/0) over the pod's models; None until it re-checked.
    probe_cosine: float | None = None
    probe_order_kept: bool | None = None
    #: The engine counters (inputs run, seconds busy) summed over the pod's models; None when not exported.
    inputs: float | None = None
    busy_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.in_flight is not None


@dataclass(frozen=True)
class Reading:
    """One look at the fleet: total in flight (None when unknown) and what went wrong on the way.

    ``pods`` holds the per-pod answers of a direct scrape (empty for Prometheus): ``in_flight`` is None
    as soon as one pod failed, because the plain sum would undercount; stale.py turns the per-pod
    answers plus memory into the number the autoscaler uses.
    """

    in_flight: float | None
    source: str
    scraped: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)
    async_depth: float | None = None  # unfinished async jobs in Redis; None when no replica runs asyncq
    pods: tuple[PodReading, ...] = ()


# ---------------------------------------------------------------- direct scraping


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _http_port(pod: Mapping[str, Any], default: int) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def pod_targets(pods: Iterable[Mapping[str, Any]], default_port: int = 8080) -> list[Target]:
    """Ready, running, not-terminating pods with an IP; the port is the container port named ``http``."""
    targets = []
    for pod in pods:
        if _pod_ready(pod):
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            port = _http_port(pod, default_port)
            targets.append(Target(pod["metadata"]["name"], f"http://{host}:{port}/metrics"))
    return sorted(targets, key=lambda t: t.pod)


def _samples(text: str, metric: str) -> list[float]:
    return [sample.value for family in text_string_to_metric_families(text) if family.name == metric
            for sample in family.samples if sample.name == metric and math.isfinite(sample.value)]


def parse_in_flight(text: str, metric: str = IN_FLIGHT_METRIC) -> float:
    """Sum of every sample of ``metric`` in one exposition; ValueError when the metric is absent."""
    values = _samples(text, metric)
    if not values:
        raise ValueError(f"{metric} not exposed")
    return sum(values)


def parse_async_depth(text: str) -> float | None:
    values = _samples(text, ASYNC_DEPTH_METRIC)
    return max(values) if values else None


def parse_probe(text: str) -> tuple[float | None, bool | None]:
    """(lowest probe cosine, whether every model kept the probe's order) in one exposition; None for a
    gauge the runtime does not export (yet: it appears after the first periodic re-check)."""
    cosines = _samples(text, PROBE_COSINE_METRIC)
    orders = _samples(text, PROBE_ORDER_METRIC)
    return (min(cosines) if cosines else None), (min(orders) >= 0.5 if orders else None)


def parse_engine_counters(text: str) -> tuple[float | None, float | None]:
    """(inputs run through the engine, seconds the engine was busy), each summed over the pod's models;
    None for a counter the runtime does not export. Matched by sample name: the parser names a counter's
    family without its ``_total``."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (INPUTS_METRIC, BUSY_METRIC) and math.isfinite(sample.value):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found.get(INPUTS_METRIC), found.get(BUSY_METRIC)


class _BodyTooLarge(Exception):
    pass


async def _read_capped(client: httpx.AsyncClient, url: str, max_body_bytes: int) -> bytes:
    """The body of ``GET url``, or _BodyTooLarge as soon as it is known to exceed the cap.

    Never returns a truncated body: a half-read exposition would parse as a smaller, wrong number.
    """
    # identity: the cap then counts the bytes on the wire, and no compressed body can inflate past it
    # between two checks.
    async with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as response:
        response.raise_for_status()
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise _BodyTooLarge(f"Content-Length {declared}")
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > max_body_bytes:
                raise _BodyTooLarge(f"more than {size} bytes read")
            chunks.append(chunk)
        return b"".join(chunks)


async def scrape_pod(client: httpx.AsyncClient, target: Target, deadline_s: float = DEFAULT_SCRAPE_DEADLINE_S,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> PodReading:
    """One pod's gauges, or a failed `PodReading` whose ``error`` says why (a failing pod is data, not an error)."""
    try:
        async with asyncio.timeout(deadline_s):
            body = await _read_capped(client, target.url, max_body_bytes)
        text = body.decode("utf-8")
        cosine, order_kept = parse_probe(text)
        inputs, busy_s = parse_engine_counters(text)
        return PodReading(target.pod, parse_in_flight(text), parse_async_depth(text), probe_cosine=cosine,
                          probe_order_kept=order_kept, inputs=inputs, busy_s=busy_s)
    except TimeoutError:
        reason = f"no complete answer within {deadline_s:g}s"
    except _BodyTooLarge as exc:
        reason = f"body over the {max_body_bytes}-byte cap ({exc}); not parsed"
    except (httpx.HTTPError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        reason = f"{type(exc).__name__}: {exc}"
    return PodReading(target.pod, None, error=reason)


async def scrape(targets: Sequence[Target], timeout_s: float = DEFAULT_SCRAPE_DEADLINE_S,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Reading:
    """Scrape every target at once; returns within about ``timeout_s`` whatever the pods do.

    ``timeout_s`` is each pod's whole-request deadline, and the pods run concurrently, so one tick's
    scrape is bounded by it. The total is None as soon as one pod failed (the sum of the rest would
    undercount); ``pods`` keeps every pod's own answer for stale.py.
    """
    if not targets:
        return Reading(in_flight=0.0, source="pods", scraped=0)
    # One connection per pod: a large fleet must not queue behind httpx's default pool limit.
    limits = httpx.Limits(max_connections=len(targets), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        results = await asyncio.gather(*(scrape_pod(client, t, timeout_s, max_body_bytes) for t in targets))
    errors = tuple(f"{r.pod}: {r.error}" for r in results if r.error is not None)
    answered = [r for r in results if r.in_flight is not None]
    depths = [r.async_depth for r in answered if r.async_depth is not None]
    depth = max(depths) if depths else None
    if errors:
        log.debug("scrape failed for %d of %d pods: %s", len(errors), len(targets), "; ".join(errors))
    total = None if errors else float(sum(r.in_flight or 0.0 for r in answered))
    return Reading(in_flight=total, source="pods", scraped=len(answered), errors=errors, async_depth=depth,
                   pods=tuple(results))


# ---------------------------------------------------------------- Prometheus


def render_query(query: str | None, namespace: str, name: str, service: str | None = None) -> str:
    return Template(query or DEFAULT_QUERY).safe_substitute(
        namespace=namespace, name=name, service=service or name
    )


#: Seconds Prometheus may spend evaluating one query (sent as its ``timeout`` parameter).
PROMETHEUS_QUERY_TIMEOUT_S = 5.0
#: What the client waits beyond that, for the answer to arrive: connecting, and each read of the answer,
#: is bounded by ``timeout_s + PROMETHEUS_GRACE_S``, and nothing is retried (the next tick asks again).
#: A Prometheus that accepts and never answers therefore costs one query at most that long.
PROMETHEUS_GRACE_S = 1.0


def _prometheus(url: str, timeout_s: float, **kwargs: Any) -> Any:
    """A ``PrometheusConnect`` whose every request is bounded and never retried. (By default it has no
    time-out at all, and retries each request three times with back-off.)"""
    from prometheus_api_client import PrometheusConnect
    from urllib3.util.retry import Retry

    bound = timeout_s + PROMETHEUS_GRACE_S
    return PrometheusConnect(url=url, timeout=(bound, bound), retry=Retry(total=0, redirect=False), **kwargs)


def query_prometheus(url: str, query: str, timeout_s: float = PROMETHEUS_QUERY_TIMEOUT_S) -> Reading:
    """Run one instant query; the answer is the sum of the returned vector (an empty vector is 0)."""
    from prometheus_api_client import PrometheusApiClientException

    try:
        prom = _prometheus(url, timeout_s, disable_ssl=False)
        result = prom.custom_query(query, params={"timeout": f"{timeout_s:g}s"})
    except (PrometheusApiClientException, OSError, ValueError) as exc:  # requests' errors are OSErrors
        return Reading(in_flight=None, source="prometheus", errors=(f"{type(exc).__name__}: {exc}",))
    return Reading(in_flight=_vector_sum(result), source="prometheus", scraped=len(result or []))


def _vector_sum(result: list[dict[str, Any]] | None) -> float:
    total = 0.0
    for series in result or []:
        number = float((series.get("value") or [None, "nan"])[1])
        if math.isfinite(number):
            total += number
    return total


def query_probe(url: str, namespace: str, name: str, service: str, timeout_s: float = PROMETHEUS_QUERY_TIMEOUT_S
                ) -> tuple[PodReading, ...] | None:
    """Each pod's probe figures from Prometheus (`PROBE_COSINE_QUERY`, `PROBE_ORDER_QUERY`, substituted as
    the in-flight query is); None when Prometheus cannot answer (the verdict then stays as it was)."""
    from prometheus_api_client import PrometheusApiClientException

    by_pod: dict[str, dict[str, float]] = {}
    try:
        prom = _prometheus(url, timeout_s)
        for key, query in (("cosine", PROBE_COSINE_QUERY), ("order", PROBE_ORDER_QUERY)):
            result = prom.custom_query(render_query(query, namespace, name, service),
                                       params={"timeout": f"{timeout_s:g}s"})
            for series in result or []:
                pod = (series.get("metric") or {}).get("pod")
                number = float((series.get("value") or [None, "nan"])[1])
                if pod and math.isfinite(number):
                    by_pod.setdefault(pod, {})[key] = number
    except (PrometheusApiClientException, OSError, ValueError) as exc:
        log.warning("probe drift unknown: %s", exc)
        return None
    return tuple(PodReading(pod, None, probe_cosine=v.get("cosine"),
                            probe_order_kept=None if "order" not in v else v["order"] >= 0.5)
                 for pod, v in sorted(by_pod.items()))


def query_async_depth(url: str, query: str, timeout_s: float = PROMETHEUS_QUERY_TIMEOUT_S) -> float | None:
    """The async backlog from Prometheus; None when unknown or when no replica exports it."""
    from prometheus_api_client import PrometheusApiClientException

    try:
        result = _prometheus(url, timeout_s).custom_query(query, params={"timeout": f"{timeout_s:g}s"})
    except (PrometheusApiClientException, OSError, ValueError) as exc:
        log.warning("async queue depth unknown: %s", exc)
        return None
    return _vector_sum(result) if result else None
