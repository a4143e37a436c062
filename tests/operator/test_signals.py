"""Autoscaler signal sources: direct scraping of real metric servers, and a real Prometheus.

Also scraping under failure (issue 13): real servers on 127.0.0.1 that flood, drip, hang or refuse,
and the autoscaler's decisions rising while one replica does not answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from embedfleet.operator.autoscale import AutoscalerConfig, History, Observation, desired_replicas, trim_observations
from embedfleet.operator.signals import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_QUERY,
    PodReading,
    Reading,
    Target,
    parse_in_flight,
    pod_targets,
    query_prometheus,
    render_query,
    scrape,
)
from embedfleet.operator.stale import LastSeen, count_pods

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
    assert reading == Reading(in_flight=50.0, source="pods", scraped=2,
                              pods=(PodReading("one", 20.0), PodReading("two", 30.0)))
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

    config = AutoscalerConfig(min_replicas=1, max_replicas=20, in_flight_per_replica=32, target_utilization=1.0)
    without = desired_replicas([Observation(0.0, 50.0, 2)], config, History(), 0.0)
    with_jobs = desired_replicas([Observation(0.0, 50.0, 2, 200.0)], config, History(), 0.0)
    assert without.replicas == 2
    assert with_jobs.replicas > 2 and "250" in with_jobs.reason and "needs 8" in with_jobs.reason


def test_a_silent_pod_makes_the_plain_sum_unknown(metrics_servers: Callable[[], MetricsServer]) -> None:
    """The sum of the rest would undercount; each pod's own answer is kept for stale.py to count."""
    alive = metrics_servers()
    alive.set(5)
    dead = Target("dead", f"http://127.0.0.1:{free_port()}/metrics")
    reading = asyncio.run(scrape([Target("alive", alive.url + "/metrics"), dead], timeout_s=1))
    assert reading.in_flight is None
    assert reading.scraped == 1 and reading.errors and reading.errors[0].startswith("dead:")
    assert reading.pods[0] == PodReading("alive", 5.0)
    assert reading.pods[1].pod == "dead" and not reading.pods[1].ok and "ConnectError" in str(reading.pods[1].error)


def test_no_pods_means_nothing_in_flight() -> None:
    assert asyncio.run(scrape([])).in_flight == 0.0


# ---------------------------------------------------------------- scraping under failure (issue 13)

GOOD_BODY = b"# TYPE embedfleet_requests_in_flight gauge\nembedfleet_requests_in_flight 7\n"


class Misbehaving(BaseHTTPRequestHandler):
    """/metrics answers the way a broken pod might; ``server.mode`` picks how.

    huge: a valid exposition padded to 5 MiB, with Content-Length. huge-unsized: the same, streamed
    with no Content-Length (close-delimited), so only counting the bytes can stop it. drip: headers at
    once, then one byte of a valid exposition every 50 ms for minutes — every single read is quick, so
    only a whole-request deadline stops it.
    """

    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        mode = self.server.mode  # type: ignore[attr-defined]
        try:
            if mode in ("huge", "huge-unsized"):
                padding = b"# " + b"x" * 1021 + b"\n"
                body = GOOD_BODY + padding * (5 * 1024)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                if mode == "huge":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for start in range(0, len(body), 65536):
                    self.wfile.write(body[start:start + 65536])
            elif mode == "drip":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.flush()
                stop_at = time.monotonic() + 300
                while time.monotonic() < stop_at:  # ends when the client hangs up (BrokenPipe)
                    for byte in GOOD_BODY:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            return

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def misbehaving() -> Iterator[Callable[[str], str]]:
    """Start a Misbehaving server in a thread on 127.0.0.1; returns its /metrics URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(mode: str) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
        server.daemon_threads = True
        server.mode = mode  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/metrics"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hanging_url() -> Iterator[str]:
    """A socket that listens and never accepts: the kernel completes the handshake, nobody answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"


def test_bodies_over_the_cap_fail_without_being_parsed(misbehaving: Callable[[str], str]) -> None:
    """Both 5 MiB bodies start with a valid gauge: a partial parse would have read 7."""
    targets = [Target("sized", misbehaving("huge")), Target("unsized", misbehaving("huge-unsized"))]
    reading = asyncio.run(scrape(targets, timeout_s=10))
    sized, unsized = reading.pods
    assert sized.in_flight is None and f"over the {DEFAULT_MAX_BODY_BYTES}-byte cap" in str(sized.error)
    assert "Content-Length" in str(sized.error)  # refused on the header, before reading the body
    assert unsized.in_flight is None and f"over the {DEFAULT_MAX_BODY_BYTES}-byte cap" in str(unsized.error)
    assert "bytes read" in str(unsized.error)  # stopped while counting the stream
    assert reading.in_flight is None and reading.scraped == 0


def test_the_cap_is_exact(metrics_servers: Callable[[], MetricsServer]) -> None:
    good = metrics_servers()
    good.set(3)
    size = len(httpx.get(good.url + "/metrics", headers={"Accept-Encoding": "identity"}).content)
    target = [Target("good", good.url + "/metrics")]
    assert asyncio.run(scrape(target, max_body_bytes=size)).in_flight == 3.0
    over = asyncio.run(scrape(target, max_body_bytes=size - 1))
    assert over.in_flight is None and "cap" in str(over.pods[0].error)


def test_one_deadline_bounds_the_whole_scrape(
    misbehaving: Callable[[str], str], hanging_url: str, metrics_servers: Callable[[], MetricsServer]
) -> None:
    """A good pod is read while a dripping, a hanging, a flooding and a refusing one fail with reasons,
    and the whole scrape returns after about one deadline. The drip alone would take minutes: each
    byte comes well inside httpx's per-read timeout, so only the whole-request deadline ends it."""
    good = metrics_servers()
    good.set(12)
    targets = [
        Target("good", good.url + "/metrics"),
        Target("drip", misbehaving("drip")),
        Target("hang", hanging_url),
        Target("huge", misbehaving("huge-unsized")),
        Target("refused", f"http://127.0.0.1:{free_port()}/metrics"),
    ]
    started = time.monotonic()
    # 5 s: the good pod is read well inside it even while the others' servers (threads of this process)
    # compete for the CPU; the drip alone would take minutes
    reading = asyncio.run(scrape(targets, timeout_s=5.0))
    elapsed = time.monotonic() - started
    by_pod = {p.pod: p for p in reading.pods}
    assert by_pod["good"] == PodReading("good", 12.0)
    assert by_pod["drip"].error == "no complete answer within 5s"
    assert by_pod["hang"].in_flight is None and by_pod["hang"].error
    assert "cap" in str(by_pod["huge"].error)
    assert "ConnectError" in str(by_pod["refused"].error)
    assert reading.scraped == 1 and len(reading.errors) == 4
    # Returned at all, far short of the drip's minutes; the margin is for a loaded CI machine.
    assert elapsed < 30, elapsed


@pytest.mark.parametrize("failure", ["refuses", "hangs"])
def test_one_replica_unreachable_under_load_desired_replicas_still_rise(
    failure: str, metrics_servers: Callable[[], MetricsServer]
) -> None:
    """Issue 13. Three replicas at 20 in flight each (target 22.4: keep 3). Then two of them climb to
    45 while the third stops answering — its process stopped (connection refused) or frozen with
    SIGSTOP (the kernel accepts, nobody answers). The plain sum is unknown, which used to freeze the
    autoscaler; counted from memory the total keeps rising, and so do the desired replicas.

    The loop is the daemon's own composition (scrape -> stale.count_pods -> desired_replicas) with the
    decision clock passed in; the pods are real HTTP servers."""
    config = AutoscalerConfig(in_flight_per_replica=32, target_utilization=0.7, min_replicas=1, max_replicas=10)
    pods = [metrics_servers() for _ in range(3)]
    targets = [Target(f"pod-{i}", s.url + "/metrics") for i, s in enumerate(pods)]
    for server in pods:
        server.set(20)

    observations: list[Observation] = []
    history = History(current_replicas=3)
    memory: dict[str, LastSeen] = {}

    def tick(now: float) -> tuple[Reading, float, int]:
        nonlocal observations, history, memory
        reading = asyncio.run(scrape(targets, timeout_s=1.0))
        fleet = count_pods(reading.pods, memory, now, config.target_per_replica, config.last_known_hold_s)
        memory = dict(fleet.memory)
        assert fleet.in_flight is not None  # never frozen while some pod answers
        observations = trim_observations([*observations, Observation(now, fleet.in_flight, 3)], config, now)
        decision = desired_replicas(observations, config, history, now)
        history = decision.history
        return reading, fleet.in_flight, decision.replicas

    reading, total, replicas = tick(0.0)
    assert reading.in_flight == 60.0 and total == 60.0 and replicas == 3

    stopped = pods[2]
    try:
        if failure == "refuses":
            stopped.stop()
        else:
            stopped.proc.send_signal(signal.SIGSTOP)
        pods[0].set(45)
        pods[1].set(45)
        seen = []
        for now in (2.0, 4.0, 6.0, 8.0):
            reading, total, replicas = tick(now)
            assert reading.in_flight is None and reading.errors[0].startswith("pod-2:")  # plain sum unknown
            assert ("ConnectError" if failure == "refuses" else "no complete answer") in reading.errors[0]
            assert total == 45 + 45 + config.target_per_replica  # pod-2: max(last known 20, target 22.4)
            seen.append(replicas)
    finally:
        if stopped.proc.poll() is None:
            stopped.proc.send_signal(signal.SIGCONT)
    assert seen == sorted(seen) and seen[0] > 3, seen  # the first tick after the failure already rises
    assert history.current_replicas == seen[-1]


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


@pytest.fixture
def hanging_prometheus() -> Iterator[str]:
    """A "Prometheus" whose socket accepts every connection (the kernel completes the handshake) and
    never answers a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_a_prometheus_that_accepts_and_hangs_is_a_failure_within_the_bound(hanging_prometheus: str) -> None:
    """Each query returns, as an unknown reading (which the autoscaler answers by keeping the size), within
    the documented bound: Prometheus' query time-out plus the client's grace, with no retry."""
    from embedfleet.operator.signals import PROMETHEUS_GRACE_S, query_async_depth, query_probe

    timeout_s = 0.5
    bound = timeout_s + PROMETHEUS_GRACE_S
    calls = {
        "in flight": lambda: query_prometheus(hanging_prometheus, DEFAULT_QUERY, timeout_s=timeout_s).in_flight,
        "async depth": lambda: query_async_depth(hanging_prometheus, DEFAULT_QUERY, timeout_s=timeout_s),
        "probe": lambda: query_probe(hanging_prometheus, "ml", "minilm", "minilm", timeout_s=timeout_s),
    }
    for what, call in calls.items():
        answer: list[object] = []
        started = time.monotonic()
        worker = threading.Thread(target=lambda call=call, answer=answer: answer.append(call()), daemon=True)
        worker.start()
        worker.join(bound + 5)  # a hung query must not hang the test suite
        assert answer, f"{what}: still waiting on a Prometheus that never answers after {bound + 5:g} s"
        elapsed = time.monotonic() - started
        assert answer == [None], (what, answer)
        assert elapsed < bound + 0.5, f"{what}: {elapsed:.2f} s, bound {bound:g} s"
