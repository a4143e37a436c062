"""`embedfleet operator run`'s timing flags: the hub loop's and the spoke heartbeat's intervals.

They travel to the code that reads them as ``EMBEDFLEET_*`` variables (hub/controller.py, spoke/heartbeat.py), so
the contract tested here is: a flag given sets its variable, a flag left out leaves the variable alone (an
inherited value or the reader's default applies), and a value that would spin a loop or expire a lease at
once is refused before anything starts, with exit status 2 and the flag's name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

import pytest
from tests.kube.controlplane import ROOT

from embedfleet.operator import cli
from embedfleet.operator.hub import controller as loop
from embedfleet.operator.spoke import heartbeat
from embedfleet.runtime import cli as top_cli

#: flag -> the variable it sets.
FLAGS = {
    "--hub-interval": "EMBEDFLEET_HUB_INTERVAL",
    "--hub-ramp-seconds": "EMBEDFLEET_HUB_RAMP_SECONDS",
    "--spoke-write-timeout": "EMBEDFLEET_HUB_WRITE_TIMEOUT",
    "--heartbeat-interval": "EMBEDFLEET_HEARTBEAT_INTERVAL",
    "--heartbeat-lease-duration": "EMBEDFLEET_LEASE_DURATION",
}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="embedfleet operator")
    cli.add_arguments(parser)
    return parser.parse_args(["run", *argv])


def test_variable_names_are_the_ones_the_loops_read() -> None:
    """The CLI names the variables itself (so parsing never imports the handlers); they must not drift."""
    assert cli.ENV_HUB_INTERVAL == loop.ENV_INTERVAL
    assert cli.ENV_HUB_RAMP == loop.ENV_RAMP
    assert cli.ENV_HEARTBEAT_INTERVAL == heartbeat.ENV_INTERVAL
    assert cli.ENV_HEARTBEAT_DURATION == heartbeat.ENV_DURATION
    # (a hub loop older than the write time-out has no such name, and nothing to drift from)
    assert getattr(loop, "ENV_WRITE_TIMEOUT", cli.ENV_HUB_WRITE_TIMEOUT) == cli.ENV_HUB_WRITE_TIMEOUT


def test_each_flag_sets_its_variable() -> None:
    args = parse("--hub-interval=1.5", "--hub-ramp-seconds=0", "--spoke-write-timeout=4",
                 "--heartbeat-interval=2", "--heartbeat-lease-duration=7")
    assert cli.interval_env(args) == {
        "EMBEDFLEET_HUB_INTERVAL": "1.5", "EMBEDFLEET_HUB_RAMP_SECONDS": "0", "EMBEDFLEET_HUB_WRITE_TIMEOUT": "4",
        "EMBEDFLEET_HEARTBEAT_INTERVAL": "2", "EMBEDFLEET_LEASE_DURATION": "7",
    }


def test_flags_left_out_set_nothing() -> None:
    assert cli.interval_env(parse()) == {}
    assert cli.interval_env(parse("--hub-interval=3")) == {"EMBEDFLEET_HUB_INTERVAL": "3"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--hub-interval=0"], "argument --hub-interval: must be more than zero seconds, got '0'"),
        (["--hub-interval=-1"], "argument --hub-interval: must be more than zero seconds"),
        (["--hub-interval=ten"], "argument --hub-interval: not a number of seconds: 'ten'"),
        (["--hub-interval=nan"], "argument --hub-interval: must be more than zero seconds"),
        (["--hub-interval=inf"], "argument --hub-interval: must be more than zero seconds"),
        (["--hub-ramp-seconds=-5"], "argument --hub-ramp-seconds: must be zero or more seconds"),
        (["--spoke-write-timeout=0"], "argument --spoke-write-timeout: must be more than zero seconds"),
        (["--heartbeat-interval=0"], "argument --heartbeat-interval: must be more than zero seconds"),
        (["--heartbeat-lease-duration=2.5"], "argument --heartbeat-lease-duration: must be whole seconds"),
        (["--heartbeat-lease-duration=0"], "argument --heartbeat-lease-duration: must be whole seconds, at least 1"),
    ],
)
def test_nonsense_is_refused_with_the_flags_name(argv: list[str], says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        top_cli.main(["operator", "run", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_a_lease_that_expires_between_beats_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before the operator (kopf, the API server) is touched: run() returns 2 at once."""
    assert cli.run(parse("--heartbeat-interval=10", "--heartbeat-lease-duration=10")) == 2
    assert "need --heartbeat-interval < --heartbeat-lease-duration, got 10 >= 10" in capsys.readouterr().err


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """run() up to the operator's start: what the environment holds when the operator would start."""
    import embedfleet.operator.main as operator_main

    seen: dict[str, Any] = {}

    def fake_run_operator(**kwargs: Any) -> int:
        seen["env"] = {name: os.environ.get(name) for name in FLAGS.values()}
        seen["kwargs"] = kwargs
        return 0

    monkeypatch.setattr(operator_main, "run_operator", fake_run_operator)
    for name in FLAGS.values():
        monkeypatch.delenv(name, raising=False)
    # run() also exports region, cloud and the Prometheus URL: keep this process's environment as it was.
    for name in (cli.ENV_PROMETHEUS_URL, cli.ENV_REGION, cli.ENV_CLOUD):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    return seen


def test_run_exports_the_flags_given_and_leaves_the_rest(started: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDFLEET_HEARTBEAT_INTERVAL", "3")  # inherited, e.g. from a wrapper or a test
    monkeypatch.setenv("EMBEDFLEET_HUB_INTERVAL", "9")
    assert cli.run(parse("--role=hub", "--hub-interval=1", "--spoke-write-timeout=2.5")) == 0
    assert started["env"] == {
        "EMBEDFLEET_HUB_INTERVAL": "1",  # the flag wins over the inherited value
        "EMBEDFLEET_HUB_RAMP_SECONDS": None,  # left out: unset, so the loop's default (60) applies
        "EMBEDFLEET_HUB_WRITE_TIMEOUT": "2.5",
        "EMBEDFLEET_HEARTBEAT_INTERVAL": "3",  # left out: untouched
        "EMBEDFLEET_LEASE_DURATION": None,
    }
    assert started["kwargs"]["role"] == "hub"


def test_the_console_script_exits_2_before_starting() -> None:
    """The real process: no kubeconfig, no API server needed, because the flag is refused first."""
    done = subprocess.run(
        [sys.executable, "-m", "embedfleet.runtime.cli", "operator", "run", "--role=spoke",
         "--heartbeat-interval=-1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "KUBECONFIG": "/nonexistent"},
    )
    assert done.returncode == 2, done.stderr
    assert "--heartbeat-interval: must be more than zero seconds, got '-1'" in done.stderr
