"""Scheduled floors on the real control plane, with the operator as the chart runs it (its command, its
ServiceAccount): a window that covers now raises an idle deployment from minReplicas 1 to the entry's 3,
and the status and the Scaled Event name the entry; a schedule patched so that no window covers now lets
the fleet back to 1, after the scale-down stabilization window, never before. The audit log is read at
the end.

The in-flight signal comes from a stand-in Prometheus on loopback answering every query with an empty
vector (no load): one server for any number of replicas, no pod network needed.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.kube.controlplane import Cluster, wait_until
from tests.operator.real import release, small

WINDOW_S = 10
#: Open now and for the whole test: every minute starts it, only 1 January 00:00 ends it.
ALWAYS = {"name": "peak", "start": "* * * * *", "end": "0 0 1 1 *", "timezone": "Europe/Berlin", "minReplicas": 3}
#: Open one minute a year.
NEVER_NOW = {**ALWAYS, "start": "0 0 1 1 *", "end": "1 0 1 1 *"}


class _EmptyVector(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *_: object) -> None:
        pass


@contextmanager
def idle_prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EmptyVector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _replicas(cluster: Cluster, name: str, ns: str) -> int | None:
    deployment = cluster.get_json("deployment", name, "-n", ns)
    return None if deployment is None else deployment["spec"].get("replicas")


def _events(cluster: Cluster, name: str, ns: str) -> list[dict]:
    return cluster.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]


def _reason(cluster: Cluster, name: str, ns: str) -> str:
    obj = cluster.get_json("ed", name, "-n", ns) or {}
    return ((obj.get("status") or {}).get("lastScaleDecision") or {}).get("reason") or ""


def test_a_schedule_raises_the_floor_and_lowers_it_after_the_scale_down_window(
        kube_cluster: Cluster, unique: str, tmp_path: Path) -> None:
    cluster = kube_cluster
    with idle_prometheus() as prometheus, release(cluster, tmp_path, unique) as (_system, proc):
        ns = f"sched-{unique}"
        cluster.kubectl("create", "namespace", ns)
        cluster.apply(small("peaky", ns, autoscaling={
            "minReplicas": 1, "maxReplicas": 4, "intervalSeconds": 1, "prometheusUrl": prometheus,
            "scaleDown": {"stabilizationWindowSeconds": WINDOW_S}, "schedule": [ALWAYS]}))

        wait_until(lambda: _replicas(cluster, "peaky", ns) == 3, 60, "3 replicas while the window is open")
        reason = wait_until(lambda: _reason(cluster, "peaky", ns), 30, "a recorded decision")
        assert "schedule peak keeps at least 3" in reason, reason
        wait_until(lambda: any(e["reason"] == "Scaled" and "schedule peak keeps at least 3" in e["message"]
                               for e in _events(cluster, "peaky", ns)), 30, "a Scaled Event naming the schedule")

        cluster.kubectl("patch", "embeddingdeployment", "peaky", "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"autoscaling": {"schedule": [NEVER_NOW]}}}))
        patched = time.time()
        reason = wait_until(lambda: (r := _reason(cluster, "peaky", ns)).startswith("ScaleDownStabilizing") and r,
                            30, "the hold announced")
        announced = re.match(r"ScaleDownStabilizing: holding 3 replicas until (\S+);", reason)
        assert announced, reason
        # The hold's end is the operator's own measure of the window: its last recommendation of 3 (which the
        # autoscaling loop of a loaded machine may make a few seconds before it sees the patch) plus the
        # window, written to the second, rounded down. It lies past the patch and at most a window from now,
        # and no read shows fewer than 3 before it.
        until = datetime.strptime(announced.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
        assert patched < until <= time.time() + WINDOW_S, (reason, patched)
        while (replicas := _replicas(cluster, "peaky", ns)) != 1:
            if time.time() < until:
                assert replicas == 3, f"scaled to {replicas} before the announced end of the window"
            assert time.time() < until + 60, "never back to 1"
            time.sleep(0.5)
        assert time.time() >= until
        wait_until(lambda: any(e["reason"] == "Scaled" and e["message"].startswith("scale down 3 -> 1")
                               and f"scale-down window {WINDOW_S}s passed" in e["message"]
                               for e in _events(cluster, "peaky", ns)), 30, "a Scaled Event naming the window")
        assert proc is not None and proc.unexpected_errors() == [], proc.log()[-3000:] if proc else ""
