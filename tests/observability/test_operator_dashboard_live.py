"""The operator dashboard (charts/embedfleet/dashboards/operator.json) on a real operator, scraped by a real
Prometheus.

The chart's standalone operator (its command, its ServiceAccount; tests/operator/real.py `release`) runs
against the test control plane with its metrics on a free port; Prometheus scrapes that port every second
and adds `region` as a target label, as the chart's PodMonitor does (docs/observability.md, "The operator").
One valid EmbeddingDeployment (reconciled ok) and one invalid (rejected: `invalid_spec`) give the reconcile
panels their events, the valid one's runtime pod turning Ready gives the cold-start row its one cold start;
the operator's leader gauge gives the stat its value.

Then every query of every panel outside the Hub row is sent to /api/v1/query with the dashboard's
variables substituted as test_dashboards_live.py does (region by what its own `label_values` query finds,
$__rate_interval by a window covering the run): each must parse and return data, and return nothing for a
region nobody scrapes. The Hub row's panels (round time, breakers, spoke write queue and batch time, the
informers' watch restarts) read metrics only a leading hub with spokes exports: here Prometheus only has to
parse their queries and they too must return nothing for the unscraped region;
test_hub_dashboard_live.py runs a hub with a spoke and requires their data.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kube.controlplane import ControlPlane, wait_until
from tests.kube.operator_proc import OperatorProcess
from tests.observability import panels
from tests.observability.prometheus import PROMETHEUS, PrometheusServer, scrape_config, start_prometheus
from tests.observability.test_alert_rules import RULES
from tests.operator.real import release, small, wait_condition
from tests.procs import free_port

pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus is not installed")

DASHBOARD = panels.DASHBOARDS / "operator.json"
REGION = "eu-1"
HUB_ROW = "Hub"
WINDOW = "10m"  # $__rate_interval: longer than the whole run, so every event is in the window
ED = "EmbeddingDeployment"


@dataclass
class Watched:
    operator: OperatorProcess
    prometheus: PrometheusServer


def rows(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(title of the row a panel sits under, panel) for every panel: a row's own panels when collapsed, the
    panels that follow it otherwise; "" before the first row."""
    current = ""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            current = panel["title"]
            for inner in panel.get("panels", []):
                yield current, inner
        else:
            yield current, panel


def split_queries(dashboard: Mapping[str, Any]) -> tuple[list[panels.Query], list[panels.Query]]:
    """(queries outside the Hub row, queries in it)."""
    outside, hub = [], []
    for row, panel in rows(dashboard):
        for target in panel.get("targets", []):
            q = panels.Query(dashboard["title"], panel["title"], target.get("refId", "?"), target["expr"])
            (hub if row == HUB_ROW else outside).append(q)
    return outside, hub


@pytest.fixture(scope="module")
def watched(_session_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    # kube_cluster's set-up, once for the module (that fixture is per test: it marks the audit log)
    kube_cluster = _session_plane.clusters["main"]
    if not kube_cluster.ready():
        kube_cluster.start_apiserver()
    kube_cluster.audit_mark()
    tag = "opdash"
    port = free_port()
    with release(kube_cluster, tmp_path_factory.mktemp("operator"), tag,
                 env={"EMBEDFLEET_OPERATOR_METRICS_PORT": str(port)}) as (_system, proc):
        assert proc is not None
        prometheus = start_prometheus(scrape_config(
            {"embedfleet-operator": [(f"127.0.0.1:{port}", {"region": REGION})]}, rule_files=[RULES]))
        try:
            # the cold-start panels count with increase(): their series need a sample before the first pod is Ready
            wait_until(lambda: bool(prometheus.query("embedfleet_cold_start_seconds_count")), 30,
                       "Prometheus to scrape the cold-start series at 0")
            ns = f"team-{tag}"
            kube_cluster.kubectl("create", "namespace", ns, check=False)
            kube_cluster.apply(small("counted", ns, autoscaling={"enabled": False}, replicas=1))
            wait_condition(kube_cluster, "counted", ns, "Accepted")
            kube_cluster.apply(small("broken", ns, autoscaling={"minReplicas": 5, "maxReplicas": 2}))
            wait_condition(kube_cluster, "broken", ns, "Accepted", "False")
            # what the operator counted has reached Prometheus, and rates have two samples after it
            for what, expr in [
                ("an ok reconcile", f'embedfleet_operator_reconcile_seconds_count{{kind="{ED}", result="ok"}}'),
                ("a rejected reconcile",
                 f'embedfleet_operator_reconcile_seconds_count{{kind="{ED}", result="rejected"}}'),
                ("the invalid_spec error", 'embedfleet_operator_reconcile_errors_total{reason="invalid_spec"}'),
                ("the leader gauge", 'embedfleet_operator_leader{role="standalone"} == 1'),
                ("the runtime pod's cold start", 'embedfleet_cold_start_seconds_count{phase="runtime_start"} >= 1'),
            ]:
                wait_until(lambda expr=expr: bool(prometheus.query(expr)), 60, f"Prometheus to scrape {what}")
            scraped = f'count_over_time(embedfleet_operator_reconcile_errors_total{{reason="invalid_spec"}}[{WINDOW}])'
            wait_until(lambda: bool(prometheus.query(f"{scraped} >= 3")), 30, "three scrapes of the rejection")
            assert proc.alive(), proc.log()[-3000:]
            yield Watched(proc, prometheus)
        finally:
            prometheus.stop()


def test_the_operator_made_the_events_the_panels_show(watched: Watched) -> None:
    """The operator reconciled one deployment, rejected the other and acts: otherwise an empty panel would
    prove nothing."""
    q = watched.prometheus.query
    here = f'region="{REGION}", kind="{ED}"'
    assert q(f'embedfleet_operator_reconcile_seconds_count{{{here}, result="ok"}} >= 1')
    assert q(f'embedfleet_operator_reconcile_seconds_count{{{here}, result="rejected"}} >= 1')
    assert q(f'embedfleet_operator_reconcile_errors_total{{{here}, reason="invalid_spec"}} >= 1')
    assert q(f'embedfleet_operator_leader{{region="{REGION}", role="standalone"}} == 1')
    for phase in ("scheduling", "init", "image_pull", "runtime_start"):  # the runtime pod of "counted"
        assert q(f'embedfleet_cold_start_seconds_count{{region="{REGION}", phase="{phase}"}} == 1'), phase
    errors = watched.operator.unexpected_errors()
    assert errors == [], "\n".join(map(str, errors))


def test_the_dashboard_has_a_hub_row_and_panels_outside_it() -> None:
    outside, hub = split_queries(panels.load(DASHBOARD))
    assert outside and hub
    assert len(outside) + len(hub) == len(list(panels.queries(panels.load(DASHBOARD))))
    titles = {q.panel for q in hub}
    assert {"Hub placement pass p95", "Open breakers", "Spoke write queue", "Watch restarts",
            "Hub work queue"} <= titles, titles


def test_every_panel_query_outside_the_hub_row_returns_data(watched: Watched) -> None:
    board = panels.load(DASHBOARD)
    values = panels.variable_values(watched.prometheus, board, WINDOW)
    outside, _hub = split_queries(board)
    failures = panels.failures(watched.prometheus, outside, values)
    assert not failures, "\n".join(failures)


def test_every_hub_panel_query_parses(watched: Watched) -> None:
    """A standalone operator exports no hub series, so these may be empty; Prometheus must accept them."""
    board = panels.load(DASHBOARD)
    values = panels.variable_values(watched.prometheus, board, WINDOW)
    _outside, hub = split_queries(board)
    failures = []
    for q in hub:
        expr = panels.substitute(q.expr, values)
        try:
            watched.prometheus.query(expr)
        except AssertionError as exc:
            failures.append(f"{q.where()}: Prometheus refused it ({exc}):\n    {expr}")
    assert not failures, "\n".join(failures)


def test_every_panel_filters_by_region(watched: Watched) -> None:
    """The same queries for a region nobody scrapes return nothing: the data above came through the filter,
    not around it."""
    board = panels.load(DASHBOARD)
    values = {**panels.variable_values(watched.prometheus, board, WINDOW), "region": "nowhere"}
    leaks = [f"{q.where()}: {panels.substitute(q.expr, values)}" for q in panels.queries(board)
             if watched.prometheus.query(panels.substitute(q.expr, values))]
    assert not leaks, "\n".join(leaks)
