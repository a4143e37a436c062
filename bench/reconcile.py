"""Operator at scale on the real test control plane: N EmbeddingDeployments created at once (default 300).
One JSON line, also appended to bench/results/reconcile-cpu.jsonl.

A fresh control plane (tests/kube: etcd, kube-apiserver with RBAC and audit, controller-manager,
scheduler, kwok nodes), the chart installed with role standalone, and the operator run exactly as the
chart runs it (its command, its ServiceAccount token). Then N small CPU EmbeddingDeployments (autoscaling
on, so each also has its autoscaler loop) are created back to back through the API.

Figures:
  reconcile_p50_s / p99_s / max_s   from an object's create call returning to the first time it has its
                                    Deployment and a status with Accepted=True (polled every 0.25 s)
  converged_all_s                   from the first create to the last object converged
  available_all_s                   ... to every object Available=True (kwok pods Ready)
  operator_rss_mib                  the operator's resident memory once everything converged
  steady_writes_30s                 writes the operator made in a 30 s window once every object is
                                    Available, Lease renewals left out (goal 0)
  baseline_deployments_p99_s        the same measure for N plain Deployments applied directly, in the same
                                    run on the same machine (what the API server + controllers cost
                                    alone); ratio = reconcile_p99_s / baseline_deployments_p99_s

Needs root and the control plane built (scripts/kube-tools.sh). Usage: python bench/reconcile.py [--count N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "client")]

import kubernetes  # noqa: E402
from tests.kube.controlplane import ControlPlane, missing_reason  # noqa: E402
from tests.kube.operator_proc import CHART, start_operator  # noqa: E402
from tests.operator.real import small  # noqa: E402

from _common import add_results_dir, record  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _accepted(obj: dict) -> bool:
    return any(c.get("type") == "Accepted" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _available(obj: dict) -> bool:
    return any(c.get("type") == "Available" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def measure_operator(cluster, count: int, workdir: Path) -> dict:
    cluster.helm("install", "ef", str(CHART), "-n", "embedfleet-system", "--create-namespace",
                  "-f", str(CHART / "ci" / "standalone-values.yaml"))
    proc = start_operator(cluster, workdir, release="ef", namespace="embedfleet-system",
                          values=[CHART / "ci" / "standalone-values.yaml"])
    try:
        cluster.kubectl("create", "namespace", "bench")
        api = kubernetes.client.CustomObjectsApi(cluster.api_client())
        apps = kubernetes.client.AppsV1Api(cluster.api_client())
        created: dict[str, float] = {}
        start = time.monotonic()
        for i in range(count):
            body = small(f"e{i}", "bench", autoscaling={"minReplicas": 1, "maxReplicas": 2})
            api.create_namespaced_custom_object("embedfleet.dev", "v1alpha1", "bench", "embeddingdeployments", body)
            created[f"e{i}"] = time.monotonic()
        converged: dict[str, float] = {}
        available: dict[str, float] = {}
        deadline = time.monotonic() + 900
        while (len(converged) < count or len(available) < count) and time.monotonic() < deadline:
            now = time.monotonic()
            deployments = {d.metadata.name for d in apps.list_namespaced_deployment("bench").items}
            items = api.list_namespaced_custom_object("embedfleet.dev", "v1alpha1", "bench",
                                                      "embeddingdeployments")["items"]
            for obj in items:
                name = obj["metadata"]["name"]
                if name not in converged and name in deployments and _accepted(obj):
                    converged[name] = now
                if name not in available and _available(obj):
                    available[name] = now
            time.sleep(0.25)
        latencies = [converged[n] - created[n] for n in converged]
        rss = _rss_mib(proc.popen.pid)
        time.sleep(10)  # every object Available: let the last events (SignalUnavailable, ...) land
        cluster.audit_mark()
        time.sleep(30)
        steady = [e for e in proc.writes() if e.resource != "leases"]
        by_resource: dict[str, int] = {}
        for event in steady:
            key = event.resource + (f"/{event.subresource}" if event.subresource else "")
            by_resource[key] = by_resource.get(key, 0) + 1
        return {
            "converged": len(converged),
            "reconcile_p50_s": round(statistics.median(latencies), 3) if latencies else None,
            "reconcile_p99_s": round(_percentile(latencies, 0.99), 3) if latencies else None,
            "reconcile_max_s": round(max(latencies), 3) if latencies else None,
            "converged_all_s": round(max(converged.values()) - start, 2) if converged else None,
            "available_all_s": round(max(available.values()) - start, 2) if len(available) == count else None,
            "operator_rss_mib": round(rss, 1),
            "steady_writes_30s": len(steady),
            "steady_writes_by_resource": by_resource,
            "unexpected_errors": len(proc.unexpected_errors()),
        }
    finally:
        proc.stop()


def measure_baseline(cluster, count: int) -> float:
    """p99 from create to the Deployment's first ready replica, for plain Deployments."""
    cluster.kubectl("create", "namespace", "baseline")
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    created: dict[str, float] = {}
    for i in range(count):
        apps.create_namespaced_deployment("baseline", {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"d{i}"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": f"d{i}"}},
                     "template": {"metadata": {"labels": {"app": f"d{i}"}},
                                  "spec": {"containers": [{"name": "c", "image": "example.invalid/x:1"}]}}}})
        created[f"d{i}"] = time.monotonic()
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 600
    while len(seen) < count and time.monotonic() < deadline:
        now = time.monotonic()
        for dep in apps.list_namespaced_deployment("baseline").items:
            if dep.metadata.name not in seen and (dep.status.ready_replicas or 0) >= 1:
                seen[dep.metadata.name] = now
        time.sleep(0.25)
    return _percentile([seen[n] - created[n] for n in seen], 0.99)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=300)
    add_results_dir(parser, "reconcile-cpu.jsonl")
    args = parser.parse_args()
    reason = missing_reason()
    if reason:
        print(json.dumps({"bench": "reconcile", "skipped": reason}))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="embedfleet-bench-"))
    plane = ControlPlane.start(workdir)
    try:
        cluster = plane.add_cluster("bench", nodes=[{"name": f"cpu-{i}", "cpu": "64", "memory": "256Gi"}
                                                    for i in range(1, 9)])
        result = measure_operator(cluster, args.count, workdir)
        baseline = measure_baseline(cluster, args.count)
    finally:
        plane.stop()
    result["baseline_deployments_p99_s"] = round(baseline, 3)
    if result.get("reconcile_p99_s") and baseline:
        result["ratio_p99_vs_baseline"] = round(result["reconcile_p99_s"] / baseline, 2)
    row = {"bench": "reconcile", "count": args.count, **result}
    print(json.dumps(row))
    record("reconcile", row, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
