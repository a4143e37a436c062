"""The alert rules file, checked and unit-tested by the real promtool (/usr/bin/promtool).

`embedfleet.rules.test.yaml` beside the rules holds the unit tests: each alert fires on a series that should
fire it and stays quiet on one that should not. A rules file with a weakened threshold must fail them, so the
unit tests can catch a change to the rules, not merely run.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability.prometheus import PROMTOOL
from tests.procs import ROOT

ALERTS = ROOT / "charts" / "embedfleet" / "alerts"
RULES = ALERTS / "embedfleet.rules.yaml"
UNIT_TESTS = ALERTS / "embedfleet.rules.test.yaml"

pytestmark = pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool is not installed")


def promtool(*args: str, cwd: Path = ALERTS) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def alert_names() -> set[str]:
    return {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
            if "alert" in rule}


def test_promtool_check_rules_accepts_the_file() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in yaml.safe_load(RULES.read_text())['groups'])} rules found" \
        in done.stdout


def test_promtool_unit_tests_pass() -> None:
    done = promtool("test", "rules", UNIT_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    """Each alert is named by a unit test that expects it to fire, and by one evaluation where the series
    that should not fire it are present (the neighbour series in the same test group, or an earlier time)."""
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fires = {case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    assert fires == alert_names()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            for alert in case.get("exp_alerts") or []:
                who = {k: v for k, v in alert["exp_labels"].items() if k in ("deployment", "instance", "model")}
                others = [s["series"] for s in t["input_series"]
                          if not all(f'{k}="{v}"' in s["series"] for k, v in who.items())]
                assert others, f"{case['alertname']}: no series in {t['name']!r} that should leave it quiet"


@pytest.mark.parametrize("alert, old, new", [
    ("EmbedfleetQueueWaitNearBound", "/ embedfleet_max_queue_seconds > 0.8", "/ embedfleet_max_queue_seconds > 0.95"),
    ("EmbedfleetHighErrorRate", "rate(embedfleet_gateway_requests_total[5m])) > 0.05",
     "rate(embedfleet_gateway_requests_total[5m])) > 0.5"),
    ("EmbedfleetWebhookDeadLetters", 'outcome="dead_lettered"', 'outcome="delivered"'),
    ("EmbedfleetProbeDrift", "(embedfleet_probe_cosine < 0.999)", "(embedfleet_probe_cosine < 0.9)"),
])
def test_a_changed_rule_fails_its_unit_test(tmp_path: Path, alert: str, old: str, new: str) -> None:
    text = RULES.read_text()
    assert old in text
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    done = promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0
    assert f"alertname: {alert}" in done.stdout + done.stderr
