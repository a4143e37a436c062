"""The chart ships the dashboards and the alert rules: rendered by the real `helm`, checked by promtool."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.chart.helm import by_kind, fullname, helm, template
from tests.observability import panels
from tests.observability.prometheus import PROMTOOL
from tests.observability.test_alert_rules import RULES

NAMESPACE = "embedfleet-system"


def dashboard_maps(objects: list[dict]) -> dict[str, dict]:
    return {cm["metadata"]["name"]: cm for cm in by_kind(objects, "ConfigMap")
            if cm["metadata"]["name"].startswith(f"{fullname('embedfleet')}-dashboard-")}


def test_each_dashboard_is_a_configmap_the_grafana_sidecar_loads() -> None:
    maps = dashboard_maps(template())
    files = panels.dashboard_files()
    assert len(files) == 4 and len(maps) == len(files)
    for path in files:
        cm = maps[f"{fullname('embedfleet')}-dashboard-{path.stem}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == NAMESPACE
        assert list(cm["data"]) == [path.name]
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())  # the file, unchanged


def test_sidecar_label_annotations_and_namespace_follow_values() -> None:
    objects = template(sets={"monitoring.dashboards.labels.grafana_dashboard": "null",
                             "monitoring.dashboards.labels.dashboards": "embedfleet",
                             "monitoring.dashboards.annotations.grafana_folder": "Embedfleet",
                             "monitoring.dashboards.namespace": "monitoring"})
    maps = dashboard_maps(objects)
    assert len(maps) == len(panels.dashboard_files()) == 4
    for cm in maps.values():
        assert cm["metadata"]["labels"]["dashboards"] == "embedfleet"
        assert "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Embedfleet"}
        assert cm["metadata"]["namespace"] == "monitoring"


def test_dashboards_off_renders_none() -> None:
    assert dashboard_maps(template(sets={"monitoring.dashboards.enabled": "false"})) == {}


def test_no_prometheusrule_by_default() -> None:
    """Off by default: a cluster without the Prometheus Operator's CRDs must still install the chart."""
    assert by_kind(template(), "PrometheusRule") == []


def test_prometheusrule_carries_the_rules_file(tmp_path: Path) -> None:
    (rule,) = by_kind(template(sets={"monitoring.prometheusRule.enabled": "true",
                                     "monitoring.prometheusRule.labels.release": "kube-prometheus-stack"}),
                      "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    if not Path(PROMTOOL).exists():
        pytest.skip("promtool is not installed")
    rendered = tmp_path / "rendered.rules.yaml"  # what the operator hands Prometheus, checked by Prometheus's own tool
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([PROMTOOL, "check", "rules", str(rendered)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_schema_refuses_an_unknown_monitoring_key() -> None:
    done = helm("template", "embedfleet", str(panels.DASHBOARDS.parent), "--set", "monitoring.dashboards.enabeld=true",
                check=False)
    assert done.returncode != 0 and "enabeld" in done.stderr


#: Dashboards held to region and datasource only: the operator's metrics have no `deployment` label (one
#: operator reconciles every deployment, and its PodMonitor adds only `region`), so a `deployment` variable
#: there would find no values and filter nothing.
WITHOUT_DEPLOYMENT = {"operator.json"}


def test_dashboards_select_a_datasource_and_filter_by_region_and_deployment() -> None:
    assert WITHOUT_DEPLOYMENT <= {p.name for p in panels.dashboard_files()}
    for path in panels.dashboard_files():
        board = panels.load(path)
        names = {v["name"]: v for v in panels.variables(board)}
        assert names["datasource"]["type"] == "datasource" and names["datasource"]["query"] == "prometheus", path
        filters = {"region"} if path.name in WITHOUT_DEPLOYMENT else {"region", "deployment"}
        assert filters <= set(names), path
        if path.name in WITHOUT_DEPLOYMENT:
            assert "deployment" not in names, path
        for panel in panels.panels(board):
            assert panel["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])
                assert all(f"${name}" in target["expr"] for name in filters), (path.name, panel["title"])
