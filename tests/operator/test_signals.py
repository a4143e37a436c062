"""Autoscaler signal sources: direct scraping of real metric servers, and a real Prometheus."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from embedfleet.operator.signals import (
    DEFAULT_QUERY,
    Reading,
    Target,
    parse_in_flight,
    pod_targets,
    query_prometheus,
    render_query,
    scrape,
)

HERE = Path(__file__).resolve().parent


class MetricsServer:
    """One tests/operator/fake_runtime_metrics.py process: a real HTTP server with the metric contract."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fake_runtime_metrics.py"), "--port", "0"],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("listening on "), line
        self.port = int(line.split()[-1])
        self.url = f"http://127.0.0.1:{self.port}"

    def set(self, in_flight: float, **extra: float) -> None:
        httpx.post(self.url + "/set", json={"in_flight": in_flight, **extra}, timeout=5).raise_for_status()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def metrics_servers() -> Iterator[Callable[[], MetricsServer]]:
    started: list[MetricsServer] = []

    def start() -> MetricsServer:
        server = MetricsServer()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- pure parts


def test_parse_in_flight_sums_every_sample() -> None:
    text = (
        "# TYPE embedfleet_requests_in_flight gauge\n"
        'embedfleet_requests_in_flight{model="a"} 3\n'
        'embedfleet_requests_in_flight{model="b"} 4.5\n'
        "# TYPE embedfleet_queue_requests gauge\n"
        "embedfleet_queue_requests 99\n"
    )
    assert parse_in_flight(text) == 7.5
    with pytest.raises(ValueError, match="not exposed"):
        parse_in_flight("# TYPE other gauge\nother 1\n")


def _pod(name: str, ip: str | None, ready: bool, phase: str = "Running", port: int | None = 8080) -> dict:
    ports = [{"name": "http", "containerPort": port}] if port else []
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "runtime", "ports": ports}]},
        "status": {"phase": phase, "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_pod_targets_keeps_ready_pods_with_an_ip() -> None:
    pods = [
        _pod("b", "10.0.0.2", True, port=9000),
        _pod("a", "10.0.0.1", True),
        _pod("starting", "10.0.0.3", False),
        _pod("pending", None, False, phase="Pending"),
        _pod("v6", "fd00::1", True),
        {**_pod("leaving", "10.0.0.4", True), "metadata": {"name": "leaving", "deletionTimestamp": "now"}},
    ]
    assert pod_targets(pods) == [
        Target("a", "http://10.0.0.1:8080/metrics"),
        Target("b", "http://10.0.0.2:9000/metrics"),
        Target("v6", "http://[fd00::1]:8080/metrics"),
    ]


def test_render_query_substitutes_names() -> None:
    assert render_query(None, "ml", "minilm") == DEFAULT_QUERY.replace("$namespace", "ml").replace(
        "$service", "minilm")
    assert render_query('sum(x{pod=~"$name-.*"})', "ml", "minilm") == 'sum(x{pod=~"minilm-.*"})'


# ---------------------------------------------------------------- direct scraping


def test_scrape_sums_pods(metrics_servers: Callable[[], MetricsServer]) -> None:
    one, two = metrics_servers(), metrics_servers()
    one.set(20)
    two.set(30)
    targets = [Target("one", one.url + "/metrics"), Target("two", two.url + "/metrics")]
    reading = asyncio.run(scrape(targets))
    assert reading == Reading(in_flight=50.0, source="pods", scraped=2)
    two.set(0)
    assert asyncio.run(scrape(targets)).in_flight == 20.0


def test_async_backlog_is_the_max_over_pods(metrics_servers: Callable[[], MetricsServer]) -> None:
    """Every replica reports the whole Redis queue: summing would count the backlog once per pod."""
    one, two = metrics_servers(), metrics_servers()
    one.set(3, async_depth=400)
    two.set(4, async_depth=380)  # scraped a moment later, after 20 jobs finished
    targets = [Target("one", one.url + "/metrics"), Target("two", two.url + "/metrics")]
    reading = asyncio.run(scrape(targets))
    assert reading.in_flight == 7.0 and reading.async_depth == 400.0


def test_async_backlog_scales_like_waiting_requests() -> None:
    """50 in flight + 200 queued jobs at batch 32: ceil(250 / 32) = 8 replicas wanted (the first step is
    rate-limited), where 50 in flight alone keep 2."""
    from embedfleet.operator.autoscale import AutoscalerConfig, History, Observation, desired_replicas

    config = AutoscalerConfig(min_replicas=1, max_replicas=20, max_batch_requests=32, target_utilization=1.0)
    without = desired_replicas([Observation(0.0, 50.0, 2)], config, History(), 0.0)
    with_jobs = desired_replicas([Observation(0.0, 50.0, 2, 200.0)], config, History(), 0.0)
    assert without.replicas == 2
    assert with_jobs.replicas > 2 and "250" in with_jobs.reason and "needs 8" in with_jobs.reason


def test_a_silent_pod_makes_the_total_unknown(metrics_servers: Callable[[], MetricsServer]) -> None:
    alive = metrics_servers()
    alive.set(5)
    dead = Target("dead", f"http://127.0.0.1:{free_port()}/metrics")
    reading = asyncio.run(scrape([Target("alive", alive.url + "/metrics"), dead], timeout_s=1))
    assert reading.in_flight is None
    assert reading.scraped == 1 and reading.errors and reading.errors[0].startswith("dead:")


def test_no_pods_means_nothing_in_flight() -> None:
    assert asyncio.run(scrape([])).in_flight == 0.0


# ---------------------------------------------------------------- Prometheus


@pytest.fixture
def prometheus(
    tmp_path: Path, metrics_servers: Callable[[], MetricsServer]
) -> Iterator[tuple[str, MetricsServer]]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` binary is not installed (scripts/setup.sh --test installs it via apt)")
    target = metrics_servers()
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: runtime\n"
        "    scrape_interval: 1s\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{target.port}'], "
        "labels: {namespace: ml, service: minilm}}]\n"
    )
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "HOME": str(tmp_path)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "prometheus exited"
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:  # a start-up timeout, not a speed check
                pytest.fail("prometheus did not become ready in 60 s")
            time.sleep(0.2)
        yield url, target
    finally:
        proc.terminate()
        proc.wait(20)


def _wait_for(url: str, query: str, expected: float) -> Reading:
    deadline = time.monotonic() + 60
    while True:
        reading = query_prometheus(url, query)
        if reading.in_flight == expected:
            return reading
        if time.monotonic() > deadline:  # a wait for a scrape to land, not a speed check
            pytest.fail(f"prometheus never answered {expected}: last {reading}")
        time.sleep(0.5)


def test_prometheus_query_follows_the_gauge(prometheus: tuple[str, MetricsServer]) -> None:
    url, target = prometheus
    query = render_query(None, "ml", "minilm")
    target.set(42)
    reading = _wait_for(url, query, 42.0)
    assert reading.source == "prometheus" and reading.scraped == 1
    target.set(7)
    _wait_for(url, query, 7.0)
    # Another deployment's query sees none of it: an empty vector sums to 0 (and says it saw 0 series).
    other = query_prometheus(url, render_query(None, "ml", "other"))
    assert other.in_flight == 0.0 and other.scraped == 0


def test_prometheus_errors_are_reported_not_raised(prometheus: tuple[str, MetricsServer]) -> None:
    url, _ = prometheus
    bad = query_prometheus(url, "sum(")  # PromQL syntax error
    assert bad.in_flight is None and bad.errors
    down = query_prometheus(f"http://127.0.0.1:{free_port()}", DEFAULT_QUERY)
    assert down.in_flight is None and down.errors
