"""The operator's own metrics on a real API server: the chart's operator (its command, its ServiceAccount)
reconciles an EmbeddingDeployment and refuses an invalid one, and its /metrics, scraped over HTTP on the
port the chart's variable names, says so."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tests.kube.controlplane import Cluster, wait_until
from tests.operator.real import release, small, wait_condition
from tests.procs import free_port

ED = "EmbeddingDeployment"


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of one GET /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_reconciles_rejections_and_leadership_are_scraped(kube_cluster: Cluster, unique: str, tmp_path: Path) -> None:
    port = free_port()
    env = {"EMBEDFLEET_OPERATOR_METRICS_PORT": str(port)}
    with release(kube_cluster, tmp_path, unique, env=env) as (_system, proc):
        assert proc is not None
        ns = f"team-{unique}"
        kube_cluster.kubectl("create", "namespace", ns)
        kube_cluster.apply(small("counted", ns, autoscaling={"enabled": False}, replicas=1))
        wait_condition(kube_cluster, "counted", ns, "Accepted")
        ok = wait_until(lambda: value(scrape(port), "embedfleet_operator_reconcile_seconds_count",
                                      kind=ED, result="ok") >= 1 or None, 30, "an ok reconcile counted")
        assert ok
        samples = scrape(port)
        assert value(samples, "embedfleet_operator_leader", role="standalone") == 1
        assert value(samples, "embedfleet_operator_reconcile_seconds_bucket", kind=ED, result="ok", le="+Inf") >= 1

        bad = small("broken", ns, autoscaling={"minReplicas": 5, "maxReplicas": 2})
        kube_cluster.apply(bad)
        wait_condition(kube_cluster, "broken", ns, "Accepted", "False")

        def rejected() -> dict | None:
            now = scrape(port)
            counted = (value(now, "embedfleet_operator_reconcile_seconds_count", kind=ED, result="rejected") >= 1
                       and value(now, "embedfleet_operator_reconcile_errors_total", kind=ED,
                                 reason="invalid_spec") >= 1)
            return now if counted else None

        wait_until(rejected, 30, "the rejection counted")
        assert proc.alive(), proc.log()[-3000:]
        errors = proc.unexpected_errors()
        assert errors == [], "\n".join(map(str, errors))
