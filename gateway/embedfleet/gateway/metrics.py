"""The gateway's Prometheus metrics, in one registry made per gateway (no process-wide state).

Events are counters and histograms updated as they happen; the state an autoscaler reads (held and
in-flight requests, replicas able to take work) is read from the fleet when scraped, so it can never
drift from what /gateway/load says. `deployment` is a deployment the gateway fronts, or `-` for a
request that named no known one (so clients cannot grow the series); `replica` is a replica URL the
gateway knows (from its flags or the cluster's EndpointSlices, never from a client).
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


class _ReplicaWaits:
    """Collector: each known replica's expected wait, as the gateway routes by it, at scrape time."""

    def __init__(self, waits: Callable[[], dict[str, dict[str, float]]]) -> None:
        self.waits = waits

    def collect(self):
        family = GaugeMetricFamily("embedfleet_gateway_replica_expected_wait_seconds",
                                   "A replica's expected wait as the gateway routes by it: its last reported queue "
                                   "wait plus this gateway's requests in flight to it times its service time",
                                   labels=["deployment", "replica"])
        for deployment, replicas in self.waits().items():
            for url, wait in replicas.items():
                family.add_metric([deployment, url], wait)
        yield family

    def describe(self):
        return []


class GatewayMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, dict]],
                 replica_waits: Callable[[], dict[str, dict[str, float]]] = dict) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("embedfleet_gateway_requests", "Requests answered, by HTTP status",
                                ["deployment", "code"], registry=r)
        self.retries = Counter("embedfleet_gateway_retries", "Requests sent again to another replica because the "
                               "first did not take them (draining, connection refused or reset, another "
                               "vector space, or another region that could not take them either: spill_refused)",
                               ["deployment", "reason"], registry=r)
        self.upstream_seconds = Histogram("embedfleet_gateway_upstream_seconds", "Time from sending a request to a "
                                          "replica to the end of its answer", ["deployment"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.cold_start = Histogram("embedfleet_gateway_cold_start_seconds", "Held requests: time from being held "
                                    "to the first byte of a replica's answer", ["deployment"],
                                    buckets=COLD_START_BUCKETS, registry=r)
        self.spilled = Counter("embedfleet_gateway_spilled", "Requests sent to another region's gateway (spill.py), "
                               "by the region they went to and why: cold (no replica here could take work) or "
                               "queue (every replica here was over the bound)", ["deployment", "to", "reason"],
                               registry=r)
        self.shed = Counter("embedfleet_gateway_shed", "Requests refused at once (429 overloaded) because every "
                            "replica's expected wait was over the bound (shed.py)", ["deployment", "reason"],
                            registry=r)
        self.ejections = Counter("embedfleet_gateway_ejections", "Replicas ejected for a while after failing "
                                 "requests in a row (eject.py)", ["deployment"], registry=r)
        self.watch_restarts = Counter("embedfleet_gateway_watch_restarts", "Watches of the API server opened "
                                      "again after a failure or an expired version (kubernetes mode)", ["kind"],
                                      registry=r)
        r.register(_FleetState(snapshot))
        r.register(_ReplicaWaits(replica_waits))
