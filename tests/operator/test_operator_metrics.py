"""The operator's own metrics without an API server: the handler wrapper's outcomes, that the role's kopf
handlers are wrapped in the registry, the port flag, and the chart's monitor and alert rules (`helm template`,
promtool)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import shutil
import subprocess
from pathlib import Path

import kopf
import pytest
import yaml
from prometheus_client import REGISTRY
from tests.chart.helm import CHART, CI_VALUES, helm

from embedfleet.operator import cli, main, metrics

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


class FakeResource:
    kind = "Widget"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_wrapped_handlers_count_ok_rejected_retry_and_error() -> None:
    def handler(outcome: str, **_: object) -> str:
        if outcome == "rejected":
            metrics.note_rejected()
        elif outcome == "retry":
            raise kopf.TemporaryError("later", delay=1)
        elif outcome == "error":
            raise RuntimeError("bug")
        return outcome

    timed = metrics.timed(handler)
    before = {r: sample("embedfleet_operator_reconcile_seconds_count", kind="Widget", result=r)
              for r in ("ok", "rejected", "retry", "error")}
    reasons = {r: sample("embedfleet_operator_reconcile_errors_total", kind="Widget", reason=r)
               for r in ("invalid_spec", "temporary", "exception")}
    assert timed(outcome="ok", resource=FakeResource()) == "ok"
    timed(outcome="rejected", resource=FakeResource())
    for outcome, exc in (("retry", kopf.TemporaryError), ("error", RuntimeError)):
        with pytest.raises(exc):
            timed(outcome=outcome, resource=FakeResource())
    for result in before:
        assert sample("embedfleet_operator_reconcile_seconds_count", kind="Widget", result=result) == before[result] + 1
    for reason in reasons:
        assert sample("embedfleet_operator_reconcile_errors_total", kind="Widget", reason=reason) == reasons[reason] + 1
    metrics.note_rejected()  # outside a handler: nothing to mark, no error


def test_async_handlers_stay_async() -> None:
    async def handler(**_: object) -> int:
        return 7

    timed = metrics.timed(handler)
    from kopf._core.actions.invocation import is_async_fn

    assert is_async_fn(timed)
    before = sample("embedfleet_operator_reconcile_seconds_count", kind="Widget", result="ok")
    assert asyncio.run(timed(resource=FakeResource())) == 7
    assert sample("embedfleet_operator_reconcile_seconds_count", kind="Widget", result="ok") == before + 1


def test_the_roles_reconcile_handlers_are_wrapped_in_kopfs_registry() -> None:
    for module in main.ROLE_HANDLERS["spoke"]:
        importlib.import_module(module)
    metrics.instrument_handlers()
    registry = kopf.get_default_registry()
    changing = registry._changing.get_all_handlers()
    watching = registry._watching.get_all_handlers()
    spawning = registry._spawning.get_all_handlers()
    assert changing and watching
    assert all(getattr(h.fn, "__embedfleet_timed__", False) for h in [*changing, *watching])
    timers = {h.id: getattr(h.fn, "__embedfleet_timed__", False) for h in spawning}
    assert timers["resync"] and not timers["gate_poll"]  # a timer is a reconcile, a daemon is not
    assert metrics.instrument_handlers() == 0  # once only


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["run", *flags])


def test_metrics_port_flag_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.ENV_METRICS_PORT, raising=False)
    assert cli.metrics_port(_parse()) == 8081 == metrics.DEFAULT_METRICS_PORT
    monkeypatch.setenv(cli.ENV_METRICS_PORT, "9100")
    assert cli.metrics_port(_parse()) == 9100
    assert cli.metrics_port(_parse("--metrics-port", "0")) == 0
    monkeypatch.setenv(cli.ENV_METRICS_PORT, "http")
    with pytest.raises(ValueError, match=cli.ENV_METRICS_PORT):
        cli.metrics_port(_parse())
    with pytest.raises(SystemExit):
        _parse("--metrics-port", "70000")


def test_a_port_in_use_leaves_the_operator_running_without_metrics() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert metrics.start_metrics_server(taken.getsockname()[1], host="127.0.0.1") is False


def render(*sets: str, role: str = "standalone") -> list[dict]:
    args = ["template", "ef", str(CHART), "-n", "ef-system", "-f", str(CI_VALUES[role])]
    for item in sets:
        args += ["--set", item]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def _operator_container(docs: list[dict]) -> dict:
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "ef-embedfleet"]
    (container,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
    return container


def test_no_podmonitor_by_default_but_the_metrics_port_is_named() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] == "PodMonitor"]
    container = _operator_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 8081
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[cli.ENV_METRICS_PORT] == "8081"


@pytest.mark.parametrize("role", ["standalone", "spoke", "hub"])
def test_podmonitor_scrapes_the_operators_metrics_port(role: str) -> None:
    docs = render("monitoring.operator.podMonitor.enabled=true", "monitoring.operator.port=9101",
                  "monitoring.operator.podMonitor.labels.release=kps", "monitoring.operator.podMonitor.interval=15s",
                  "region=eu-1", role=role)
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    container = _operator_container(docs)
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "ef-embedfleet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and ports[endpoint["port"]] == 9101
    assert {e["name"]: e.get("value") for e in container["env"]}[cli.ENV_METRICS_PORT] == "9101"
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    assert endpoint["relabelings"] == [{"targetLabel": "region", "replacement": "eu-1"}]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ef-system"]}
    assert monitor["metadata"]["labels"]["release"] == "kps"


def test_port_zero_exposes_no_metrics_port_and_no_monitor() -> None:
    docs = render("monitoring.operator.port=0", "monitoring.operator.podMonitor.enabled=true")
    assert not [d for d in docs if d["kind"] == "PodMonitor"]
    assert "metrics" not in {p["name"] for p in _operator_container(docs)["ports"]}


@pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool is not installed")
def test_the_rendered_operator_alerts_pass_promtool(tmp_path: Path) -> None:
    docs = render("monitoring.prometheusRule.enabled=true")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert "embedfleet_operator_reconcile_seconds_count" in alerts["EmbedfleetOperatorStalled"]["expr"]
    assert "embedfleet_operator_watch_restarts_total" in alerts["EmbedfleetOperatorWatchRestarts"]["expr"]
    rendered = tmp_path / "rendered.rules.yaml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([PROMTOOL, "check", "rules", str(rendered)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
