"""Where the autoscaler's numbers come from: Prometheus, or the runtime pods' own /metrics.

Two sources, one answer: the total of ``embedfleet_requests_in_flight`` over one deployment's pods.

* Prometheus (``prometheus-api-client``), when a URL is configured: one PromQL query, by default
  ``sum(embedfleet_requests_in_flight{namespace="$namespace",service="$service"})`` — the labels the
  Prometheus Kubernetes service discovery (and a ServiceMonitor) attach. ``$namespace``, ``$name`` and
  ``$service`` are substituted (PromQL never uses ``$``, so no escaping is needed).
* Direct scraping, when not: GET ``http://<podIP>:<port>/metrics`` of every Ready pod concurrently
  (httpx) and parse the exposition text with prometheus_client's own parser.

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
DEFAULT_QUERY = 'sum(embedfleet_requests_in_flight{namespace="$namespace",service="$service"})'
# Every replica reports the whole Redis queue, so the fleet's backlog is the max, not the sum.
ASYNC_DEPTH_QUERY = 'max(embedfleet_async_queue_depth{namespace="$namespace",service="$service"})'


@dataclass(frozen=True)
class Target:
    pod: str
    url: str


@dataclass(frozen=True)
class Reading:
    """One look at the fleet: total in flight (None when unknown) and what went wrong on the way."""

    in_flight: float | None
    source: str
    scraped: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)
    async_depth: float | None = None  # unfinished async jobs in Redis; None when no replica runs asyncq


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


async def scrape(targets: Sequence[Target], timeout_s: float = 2.0) -> Reading:
    """Scrape every target at once. Any pod that does not answer makes the total unknown."""
    if not targets:
        return Reading(in_flight=0.0, source="pods", scraped=0)

    async def one(client: httpx.AsyncClient, target: Target) -> tuple[float, float | None] | str:
        try:
            response = await client.get(target.url)
            response.raise_for_status()
            return parse_in_flight(response.text), parse_async_depth(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            return f"{target.pod}: {type(exc).__name__}: {exc}"

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        results = await asyncio.gather(*(one(client, t) for t in targets))
    errors = tuple(r for r in results if isinstance(r, str))
    values = [r for r in results if not isinstance(r, str)]
    if errors:
        log.warning("scrape failed for %d of %d pods: %s", len(errors), len(targets), "; ".join(errors))
        return Reading(in_flight=None, source="pods", scraped=len(values), errors=errors)
    depths = [d for _, d in values if d is not None]
    return Reading(in_flight=float(sum(v for v, _ in values)), source="pods", scraped=len(values),
                   async_depth=max(depths) if depths else None)


# ---------------------------------------------------------------- Prometheus


def render_query(query: str | None, namespace: str, name: str, service: str | None = None) -> str:
    return Template(query or DEFAULT_QUERY).safe_substitute(
        namespace=namespace, name=name, service=service or name
    )


def query_prometheus(url: str, query: str, timeout_s: float = 5.0) -> Reading:
    """Run one instant query; the answer is the sum of the returned vector (an empty vector is 0)."""
    from prometheus_api_client import PrometheusApiClientException, PrometheusConnect

    try:
        prom = PrometheusConnect(url=url, disable_ssl=False)
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


def query_async_depth(url: str, query: str, timeout_s: float = 5.0) -> float | None:
    """The async backlog from Prometheus; None when unknown or when no replica exports it."""
    from prometheus_api_client import PrometheusApiClientException, PrometheusConnect

    try:
        result = PrometheusConnect(url=url).custom_query(query, params={"timeout": f"{timeout_s:g}s"})
    except (PrometheusApiClientException, OSError, ValueError) as exc:
        log.warning("async queue depth unknown: %s", exc)
        return None
    return _vector_sum(result) if result else None
