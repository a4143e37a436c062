"""`embedfleet gateway` flags: upstreams parsed as NAME=URL, bad settings refused naming the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embedfleet.gateway.config import ConfigError, GatewayConfig, parse_bounds, parse_upstreams
from embedfleet.httpserver import Limits
from tests.procs import ROOT, child_env


def test_upstreams_group_replicas_by_name_in_order():
    got = parse_upstreams(["a=http://10.0.0.1:8080/", "b=http://10.0.0.2:8080", "a=http://10.0.0.3:8080",
                           "a=http://10.0.0.1:8080"])
    assert got == {"a": ["http://10.0.0.1:8080", "http://10.0.0.3:8080"], "b": ["http://10.0.0.2:8080"]}


@pytest.mark.parametrize("value", ["http://x:1", "=http://x:1", "a=x:1", "a=ftp://x", "a=http://x:1/v1",
                                   "a=http://:80"])
def test_bad_upstreams_are_refused(value):
    with pytest.raises(ConfigError, match="--upstream"):
        parse_upstreams([value])


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("port", 0, "--port"), ("poll_interval", 0, "--poll-interval"), ("hold_timeout", -1, "--hold-timeout"),
    ("max_held", -1, "--max-held"), ("request_timeout", 0, "--request-timeout"),
    ("poll_timeout", float("nan"), "--poll-timeout"), ("payload_limit", 0, "--payload-limit"),
    ("max_queue_seconds", -1, "--max-queue-seconds"), ("max_queue_seconds_bulk", float("inf"),
                                                       "--max-queue-seconds-bulk"),
    ("urgent_max_inputs", -1, "--urgent-max-inputs"), ("eject_after", -1, "--eject-after"),
    ("eject_base", 0, "--eject-base"), ("eject_max", 1, "--eject-max"), ("balance", "random", "--balance"),
    ("upstream_dead_after", 1, "--upstream-dead-after"), ("upstream_dead_after", -3, "--upstream-dead-after"),
    ("upstream_dead_after", 121, "--upstream-dead-after"),
])
def test_bad_settings_name_their_flag(field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        GatewayConfig(**{field: value})


@pytest.mark.parametrize(("field", "flag"), [
    ("head_timeout_s", "--head-timeout-seconds"), ("head_total_s", "--head-total-seconds"),
    ("body_timeout_s", "--body-timeout-seconds"), ("keep_alive_s", "--keep-alive-seconds"),
    ("max_headers", "--max-headers"), ("max_connections", "--max-connections"), ("min_body_rate", "--min-body-rate")])
@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_bad_connection_limits_name_their_flag(field, flag, value):
    with pytest.raises(ConfigError, match=flag):
        GatewayConfig(limits=Limits(**{field: value}))


def gateway(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "gateway", *args], env=child_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_no_upstream_exits_2_saying_what_is_missing():
    done = gateway()
    assert done.returncode == 2 and "--upstream NAME=URL" in done.stderr


def test_help_documents_every_flag_with_its_default():
    out = gateway("--help").stdout
    for flag in ("--upstream", "--port", "--poll-interval", "--max-held", "--hold-timeout", "--request-timeout",
                 "--payload-limit", "--cold-start-default", "--drain-timeout", "--balance", "--max-queue-seconds",
                 "--max-queue-seconds-bulk", "--urgent-max-inputs", "--eject-after", "--eject-base", "--eject-max"):
        assert flag in out
    assert "default: 256" in out and "default: 60.0" in out and "default: 8000" in out


def test_round_robin_says_it_is_a_benchmark_baseline():
    out = " ".join(gateway("--help").stdout.split())
    assert "round-robin: in turn, blind to load; only a baseline for benchmarks" in out


def test_bounds_are_parsed_by_the_spec_field_names():
    got = parse_bounds(["a=maxQueueSeconds=2,spillAfterSeconds=0", "b=maxQueueSecondsBulk=60",
                        "a=maxQueueSecondsBulk=45.5"])
    assert got == {"a": {"maxQueueSeconds": 2.0, "spillAfterSeconds": 0.0, "maxQueueSecondsBulk": 45.5},
                   "b": {"maxQueueSecondsBulk": 60.0}}


@pytest.mark.parametrize("value", ["a", "a=", "=maxQueueSeconds=2", "a=maxQueueSeconds", "a=maxQueueSeconds=0",
                                   "a=maxQueueSecondsBulk=-1", "a=spillAfterSeconds=nan", "a=maxQueue=2",
                                   "a=maxQueueSeconds=inf", "a=maxQueueSeconds=two"])
def test_bad_bounds_are_refused_naming_the_flag(value):
    with pytest.raises(ConfigError, match="--bounds"):
        parse_bounds([value])


def test_bounds_need_an_upstream_of_that_name_and_are_not_for_kubernetes_mode():
    done = gateway("--upstream", "m=http://127.0.0.1:9", "--bounds", "other=maxQueueSeconds=2")
    assert done.returncode == 2 and "--bounds names deployments with no --upstream: other" in done.stderr
    done = gateway("--kubernetes", "--bounds", "m=maxQueueSeconds=2")
    assert done.returncode == 2 and "drop --bounds" in done.stderr
