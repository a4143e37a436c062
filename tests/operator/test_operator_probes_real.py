"""The operator's probes on a real API server, as the kubelet would ask them: the chart's command run as
the chart's ServiceAccount (tests/kube/operator_proc.py), two replicas with leader election.

Readiness fails while the operator cannot reconcile (its CRDs not served yet, the API server down) and
passes once it can; liveness answers from process start and never follows the API server; a standby
waiting for the Lease is live and ready to take over, and takes over when the leader stops."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from tests.chart.helm import CHART, CI_VALUES
from tests.kube.controlplane import ROOT, Cluster, ControlPlane, wait_until
from tests.kube.operator_proc import OperatorProcess, start_operator

#: Patient election: the leader rides out an API server restart (renewDeadline) instead of exiting.
ELECTION = {"leaderElection.leaseDuration": "60", "leaderElection.renewDeadline": "45",
            "leaderElection.retryPeriod": "1", "prometheusUrl": ""}
RELEASE = "ef"
SYSTEM = "ef-system"


def probe(proc: OperatorProcess, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{proc.liveness_port}{path}", timeout=10)


def ready(proc: OperatorProcess) -> bool:
    assert proc.alive(), proc.log()[-3000:]
    return probe(proc, "/readyz").status_code == 200


def not_ready_because(proc: OperatorProcess, check: str, says: str) -> dict[str, Any] | None:
    answer = probe(proc, "/readyz")
    checks = answer.json()["checks"]
    return checks if answer.status_code == 503 and says in checks[check] else None


def no_refusals(*procs: OperatorProcess) -> None:
    """The audit log (since its mark) holds no 403/409/422 answered to these operators (their 404s on
    discovery while the CRDs were missing are expected)."""
    for proc in procs:
        errors = proc.unexpected_errors()
        assert errors == [], "\n".join(map(str, errors))


def start(cluster: Cluster, tmp_path: Path, name: str) -> OperatorProcess:
    return start_operator(cluster, tmp_path, release=RELEASE, namespace=SYSTEM, values=[CI_VALUES["standalone"]],
                          sets=ELECTION, name=name, env={"POD_NAME": name}, wait_alive=False)


def test_readiness_follows_what_the_operator_can_do_and_a_standby_is_live_and_ready(
        fresh_plane: ControlPlane, tmp_path: Path) -> None:
    cluster = fresh_plane.add_cluster("probes", nodes=None, controllers=False)
    # The chart without its CRDs: the operator's identity, its rights and Lease, nothing to reconcile.
    cluster.helm("install", RELEASE, str(CHART), "-n", SYSTEM, "--create-namespace", "--skip-crds",
                 "--wait=false", "-f", str(CI_VALUES["standalone"]),
                 *[a for key, value in ELECTION.items() for a in ("--set", f"{key}={value}")])
    first = start(cluster, tmp_path, "first")
    second = None
    try:
        live = wait_until(lambda: probe(first, "/healthz"), 60, f"first's liveness\n{first.log()[-2000:]}")
        assert live.status_code == 200, live.text
        # (While it imports its handlers it says so, too.) Then: loaded, leading, and still not ready.
        wait_until(lambda: "acquired leadership" in first.log(), 60, "first leading")
        checks = wait_until(lambda: not_ready_because(first, "api", "install the chart's CRDs"), 30,
                            "first not ready for want of the CRDs")
        assert checks["handlers"] == "ok", checks
        time.sleep(6)  # past the cached answer: still not ready, nothing changed
        assert not_ready_because(first, "api", "install the chart's CRDs")

        cluster.install_crds()
        wait_until(lambda: ready(first), 60, f"first ready once the CRDs are served\n{first.log()[-2000:]}")

        second = start(cluster, tmp_path, "second")
        wait_until(lambda: "waiting for lease" in second.log(), 60, "second waiting as a standby")
        assert probe(second, "/healthz").status_code == 200  # a standby's liveness answers
        wait_until(lambda: ready(second), 30, "the standby ready to take over")
        assert "Starting the main handler" not in second.log()  # and it runs no handler

        no_refusals(first, second)

        # The API server goes away: neither can reconcile (not ready), both stay live (a restart would
        # not help); it comes back: both ready again, the leader still leading.
        cluster.stop_apiserver()
        for proc in (first, second):
            wait_until(lambda p=proc: not_ready_because(p, "api", "unreachable"), 30, "not ready, API server down")
            assert probe(proc, "/healthz").status_code == 200
        cluster.start_apiserver()
        for proc in (first, second):
            wait_until(lambda p=proc: ready(p), 60, "ready again once the API server answers")
        # A restarted API server refuses requests for a moment while its RBAC cache fills (403 naming a
        # Role that exists); what counts is everything from here on.
        cluster.audit_mark()
        assert "acquired leadership" not in second.log()

        # The leader reconciles the example.
        cluster.kubectl("create", "namespace", "apps")
        example = yaml.safe_load((ROOT / "examples" / "embedding.yaml").read_text())
        example["metadata"]["namespace"] = "apps"
        cluster.apply(example)
        name = example["metadata"]["name"]
        wait_until(lambda: cluster.get_json("deployment", name, "-n", "apps"), 60, "the leader's Deployment")

        # A clean stop hands the Lease over; the new leader's kopf starts and it stays ready.
        assert first.stop() == 0, first.log()[-2000:]
        wait_until(lambda: "acquired leadership" in second.log(), 30, "the standby taking over")
        wait_until(lambda: "Starting the main handler" in second.log() or ready(second), 60, "second's kopf")
        wait_until(lambda: ready(second), 60, "the new leader ready")
        cluster.kubectl("delete", "embeddingdeployment", name, "-n", "apps", "--wait=true", "--timeout=60s")
        no_refusals(first, second)
    finally:
        first.stop()
        if second is not None:
            second.stop()
