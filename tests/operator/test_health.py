"""The kubelet's view of the operator and the node agent, without a cluster: the health server's answers
(operator/health.py), a kopf loop that stops running callbacks, the real operator process pointed at an
API server that does not answer, and the node agent's heartbeat files."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.kube.controlplane import ROOT, wait_until
from tests.procs import child_env, free_port, spawn, stop_process

from embedfleet.operator import health
from embedfleet.operator.cache import agent
from embedfleet.operator.health import HealthServer, loop_responsive, parse_endpoint
from embedfleet.operator.platform import PlatformPolicy


@pytest.fixture
def serve():
    servers: list[HealthServer] = []

    def start(**checks) -> str:
        port = free_port()
        servers.append(HealthServer("127.0.0.1", port, **checks).start())
        return f"http://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop()


def test_answers_name_each_check_and_fail_with_503(serve) -> None:
    url = serve(live={"ping": lambda: None}, ready={"one": lambda: None, "two": lambda: "not yet: because"})
    live = httpx.get(f"{url}/healthz")
    assert live.status_code == 200 and live.json() == {"status": "ok", "checks": {"ping": "ok"}}
    ready = httpx.get(f"{url}/readyz")
    assert ready.status_code == 503
    assert ready.json() == {"status": "failed", "checks": {"one": "ok", "two": "not yet: because"}}
    assert httpx.get(f"{url}/other").status_code == 404


def test_a_check_that_hangs_or_raises_fails_and_the_probe_still_answers(serve, monkeypatch) -> None:
    monkeypatch.setattr(health, "CHECK_TIMEOUT_S", 0.5)
    release = threading.Event()

    def boom() -> str | None:
        raise RuntimeError("broken")

    url = serve(live={}, ready={"hangs": lambda: release.wait(5) and None, "raises": boom})
    started = time.monotonic()
    answer = httpx.get(f"{url}/readyz", timeout=5)
    release.set()
    assert time.monotonic() - started < 3
    assert answer.status_code == 503
    assert answer.json()["checks"] == {"hangs": "no answer within 0.5s", "raises": "RuntimeError: broken"}


def test_endpoint_parsing_and_a_taken_port() -> None:
    assert parse_endpoint("http://0.0.0.0:8080/healthz") == ("0.0.0.0", 8080, "/healthz")
    with pytest.raises(ValueError):
        parse_endpoint("https://0.0.0.0:8080/healthz")
    with pytest.raises(ValueError):
        HealthServer("127.0.0.1", 1, live={}, ready={}, live_path="/x", ready_path="/x")
    port = free_port()
    first = HealthServer("127.0.0.1", port, live={}, ready={}).start()
    try:
        with pytest.raises(OSError):
            HealthServer("127.0.0.1", port, live={}, ready={}).start()
    finally:
        first.stop()


def test_a_blocked_event_loop_is_not_live() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert loop_responsive(loop, timeout=1) is None
        loop.call_soon_threadsafe(time.sleep, 2)  # a blocking call on the loop, as a buggy handler makes
        time.sleep(0.1)
        assert "blocked" in (loop_responsive(loop, timeout=0.5) or "")
        time.sleep(2)
        assert loop_responsive(loop, timeout=1) is None
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _unreachable_kubeconfig(path: Path) -> Path:
    port = free_port()  # nothing listens there
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: c, context: {{cluster: c, user: u}}}}]
current-context: c
""")
    return path


@pytest.mark.parametrize("election", ["--leader-elect", "--no-leader-elect"])
def test_operator_without_an_api_server_is_live_and_not_ready(tmp_path: Path, election: str) -> None:
    """The real `embedfleet operator run`: its probes answer from process start, a standby's (still
    waiting for the Lease) and an acting operator's alike; it is live, and not ready while the API server
    does not answer, saying so."""
    port = free_port()
    log = tmp_path / "operator.log"
    argv = [sys.executable, "-m", "embedfleet.runtime.cli", "operator", "run", "-A", election,
            f"--liveness=http://127.0.0.1:{port}/healthz"]
    with open(log, "wb") as out:
        proc = spawn(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                     env=child_env({"KUBECONFIG": str(_unreachable_kubeconfig(tmp_path / "kubeconfig")),
                                    "POD_NAMESPACE": "ops"}))
    try:
        live = wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5), 60,
                          f"the liveness endpoint\n{log.read_text()[-2000:]}")
        assert live.status_code == 200, live.text
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert ready.status_code == 503, ready.text
        checks = ready.json()["checks"]
        assert checks["api"].startswith("the API server is unreachable"), checks
        time.sleep(3)  # still so a moment later (no flapping to ready while nothing answers)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 503
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        assert proc.poll() is None, log.read_text()[-3000:]
        # the HTTP clients' request lines stay out of the default log
        assert "HTTP Request:" not in log.read_text()
    finally:
        stop_process(proc)


@pytest.mark.parametrize(("flags", "request_lines"), [({}, False), ({"verbose": True}, False),
                                                     ({"debug": True}, True)])
def test_http_request_lines_are_logged_only_with_debug(flags: dict[str, bool], request_lines: bool) -> None:
    """httpx logs every request at INFO (the autoscaler's scrapes: several lines every few seconds)."""
    code = ("import logging, sys; from embedfleet.operator.main import configure_logging; "
            f"configure_logging(**{flags!r}); "
            "print(all(logging.getLogger(n).isEnabledFor(logging.INFO) for n in ('httpx', 'httpcore')), "
            "logging.getLogger('httpx').isEnabledFor(logging.WARNING))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env())
    assert done.stdout.split() == [str(request_lines), "True"], done.stderr


# ---------------------------------------------------------------- the node agent's heartbeat files


class _Cluster:
    """The agent's reads and writes, answered from memory (or failing, as an unreachable server does)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def node_labels(self, name: str) -> dict[str, str]:
        if self.fail:
            raise ConnectionError("API server unreachable")
        return {}

    def list_all(self, plural: str) -> list[dict]:
        return []

    def patch_labels(self, name: str, labels: dict) -> None:
        pass


def _config(root: Path) -> agent.AgentConfig:
    root.mkdir(exist_ok=True)
    return agent.AgentConfig(node_name="n1", root=root, policy=PlatformPolicy())


def test_a_pass_that_reads_the_cluster_marks_ready_and_alive(tmp_path: Path) -> None:
    beat = agent.Heartbeat(tmp_path / "health", tmp_path / "root")
    config = _config(tmp_path / "root")
    assert agent.run_pass(config, _Cluster(), heartbeat=beat) == []
    assert (tmp_path / "health" / "ready").exists() and (tmp_path / "health" / "alive").exists()
    with pytest.raises(ConnectionError):
        agent.run_pass(config, _Cluster(fail=True), heartbeat=beat)
    beat.ready(False)  # what run() does with a failed pass
    assert not (tmp_path / "health" / "ready").exists()


def test_a_growing_download_beats_and_a_stalled_one_does_not(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    """Judged in the watcher's own looks at the folder, not in seconds: a late watcher thread on a loaded
    machine sees the same growth, only later."""
    beat = agent.Heartbeat(tmp_path / "health", root, every_s=0.2)
    alive = tmp_path / "health" / "alive"
    beat.beat()
    os.utime(alive, (0, 0))
    partial = root / f"{agent.TMP_PREFIX}abc" / "model.safetensors"
    partial.parent.mkdir()
    looks = [0]
    pulled = beat._pulled_bytes

    def counted() -> int:
        looks[0] += 1
        return pulled()

    beat._pulled_bytes = counted  # type: ignore[method-assign]

    def after_looks(n: int) -> None:
        target, deadline = looks[0] + n, time.monotonic() + 30
        while looks[0] < target:
            assert time.monotonic() < deadline, "the watcher stopped looking"
            time.sleep(0.01)

    with beat.pulling():
        for _ in range(5):
            with open(partial, "ab") as fh:
                fh.write(b"x" * 1000)
            after_looks(1)
        after_looks(2)  # the last growth seen, and one look after it
        assert alive.stat().st_mtime > time.time() - 30  # growth is progress
        os.utime(alive, (0, 0))
        after_looks(5)  # nothing written: a stalled download
        assert alive.stat().st_mtime == 0


def test_the_wait_between_passes_beats_and_ends_on_stop(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(agent, "HEARTBEAT_S", 0.1)
    beat = agent.Heartbeat(tmp_path / "health", tmp_path)
    alive = tmp_path / "health" / "alive"
    stop = threading.Event()
    beat.beat()
    os.utime(alive, (0, 0))
    started = time.monotonic()
    assert agent._wait(stop, 0.5, beat) is False
    assert 0.4 < time.monotonic() - started < 2
    assert alive.stat().st_mtime > 0  # a waiting agent is a live one
    threading.Timer(0.3, stop.set).start()
    assert agent._wait(stop, 60, beat) is True
    assert time.monotonic() - started < 5
