"""The gateway's Prometheus metrics, in one registry made per gateway (no process-wide state).

Events are counters and histograms updated as they happen; the state an autoscaler reads (held and
in-flight requests, replicas able to take work) is read from the fleet when scraped, so it can never
drift from what /gateway/load says. `deployment` is a deployment the gateway fronts, or `-` for a
request that named no known one (so clients cannot grow the series).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
COLD_START_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600)
UNKNOWN = "-"


class _FleetState:
    """Collector: gauges computed from `snapshot()` at scrape time."""

    GAUGES = (
        ("embedfleet_gateway_held_requests", "held", "Requests held because no replica of the deployment is ready"),
        ("embedfleet_gateway_requests_in_flight", "in_flight",
         "Requests the gateway is handling for the deployment, held ones included (autoscaler input)"),
        ("embedfleet_gateway_ready_replicas", "ready_replicas", "Replicas able to take work"),
        ("embedfleet_gateway_replicas", "replicas", "Replicas the gateway knows of"),
    )

    def __init__(self, snapshot: Callable[[], dict[str, dict]]) -> None:
        self.snapshot = snapshot

    def collect(self):
        state = self.snapshot()
        for name, key, text in self.GAUGES:
            family = GaugeMetricFamily(name, text, labels=["deployment"])
            for deployment, values in state.items():
                family.add_metric([deployment], values[key])
            yield family

    def describe(self):
        return []


class GatewayMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, dict]]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("embedfleet_gateway_requests", "Requests answered, by HTTP status",
                                ["deployment", "code"], registry=r)
        self.retries = Counter("embedfleet_gateway_retries", "Requests sent again to another replica because the "
                               "first did not take them (draining, connection refused or reset)",
                               ["deployment", "reason"], registry=r)
        self.upstream_seconds = Histogram("embedfleet_gateway_upstream_seconds", "Time from sending a request to a "
                                          "replica to the end of its answer", ["deployment"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.cold_start = Histogram("embedfleet_gateway_cold_start_seconds", "Held requests: time from being held "
                                    "to the first byte of a replica's answer", ["deployment"],
                                    buckets=COLD_START_BUCKETS, registry=r)
        r.register(_FleetState(snapshot))
