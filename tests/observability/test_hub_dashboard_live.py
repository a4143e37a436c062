"""The Hub row of the operator dashboard (charts/embedfleet/dashboards/operator.json) on a real hub with a
spoke, scraped by a real Prometheus.

A fleet on the test control plane (tests/hub/fleet.py: a hub and one spoke, each its own kube-apiserver, the
chart's operators as the chart's identities). The hub operator runs with its metrics on a free port, which
Prometheus scrapes every second with `region` as a target label, as the chart's PodMonitor does. The fleet
is made to do what each Hub panel shows: rounds run every second (round time), a deployment is placed on
the spoke (the spoke's write queue and batch time; its breaker's state, closed), and the spoke's API server
is stopped for a moment, so the hub's watches of it break and are opened again (watch restarts). Then every
query of the Hub row must return data, and nothing for a region nobody scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hub.fleet import ELECTION, HUB_ENV, SYSTEM, Fleet, embedding, running_fleet
from tests.kube.controlplane import wait_until
from tests.kube.operator_proc import start_operator
from tests.observability import panels
from tests.observability.prometheus import PROMETHEUS, PrometheusServer, scrape_config, start_prometheus
from tests.observability.test_operator_dashboard_live import DASHBOARD, WINDOW, split_queries
from tests.procs import free_port

pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus is not installed")

REGION = "hub-1"
NS = "ml"


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, PrometheusServer]]:
    with running_fleet(tmp_path_factory.mktemp("hubdash"), {"eu": "eu-west-1"},
                       prepare=lambda f: f.namespace(NS)) as fleet:
        # the hub again, with its metrics on a port of this test's choosing
        assert fleet.hub_proc is not None
        fleet.hub_proc.stop()
        port = free_port()
        fleet.hub_proc = start_operator(fleet.hub, fleet.workdir, release="ef-hub", namespace=SYSTEM,
                                        sets={"role": "hub", **ELECTION},
                                        env={**HUB_ENV, "EMBEDFLEET_OPERATOR_METRICS_PORT": str(port)},
                                        name="operator-hub-metrics")
        prometheus = start_prometheus(scrape_config(
            {"embedfleet-operator": [(f"127.0.0.1:{port}", {"region": REGION})]}, rule_files=[]))
        try:
            fleet.hub.apply(embedding("counted", NS, replicas=1))
            fleet.wait_settled("counted", NS, {"eu": 1})
            q = prometheus.query
            wait_until(lambda: bool(q("embedfleet_operator_hub_write_batch_seconds_count >= 1")), 60,
                       "Prometheus to scrape the spoke's write batch")
            spoke = fleet.spokes["eu"]
            spoke.stop_apiserver()
            time.sleep(3)
            spoke.start_apiserver()
            wait_until(lambda: bool(q("sum(embedfleet_operator_watch_restarts_total) >= 1")), 90,
                       "Prometheus to scrape a restarted watch of the spoke")
            wait_until(lambda: bool(q(f"count_over_time(embedfleet_operator_hub_round_seconds_count[{WINDOW}]) >= 3")),
                       30, "three scrapes of the hub's rounds")
            yield fleet, prometheus
        finally:
            prometheus.stop()


def test_every_hub_panel_query_returns_data(scraped: tuple[Fleet, PrometheusServer]) -> None:
    fleet, prometheus = scraped
    board = panels.load(DASHBOARD)
    values = panels.variable_values(prometheus, board, WINDOW)
    _outside, hub = split_queries(board)
    assert hub
    failures = panels.failures(prometheus, hub, values)
    assert not failures, "\n".join(failures)
    assert prometheus.query('embedfleet_operator_breaker_open{cluster="eu"} == 0'), "the spoke's breaker is closed"
    assert prometheus.query('embedfleet_operator_leader{role="hub"} == 1')
    assert fleet.hub_proc is not None and fleet.hub_proc.alive(), fleet.hub_proc.log()[-3000:]


def test_the_hub_panels_filter_by_region(scraped: tuple[Fleet, PrometheusServer]) -> None:
    _fleet, prometheus = scraped
    board = panels.load(DASHBOARD)
    values = {**panels.variable_values(prometheus, board, WINDOW), "region": "nowhere"}
    _outside, hub = split_queries(board)
    leaks = [f"{q.where()}: {panels.substitute(q.expr, values)}" for q in hub
             if prometheus.query(panels.substitute(q.expr, values))]
    assert not leaks, "\n".join(leaks)
