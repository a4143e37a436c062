"""Helpers for operator tests on the real control plane: a chart release with its operator process, and
readers for what the operator did (objects, conditions, its writes in the audit log)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from tests.kube.controlplane import ROOT, Cluster, wait_until
from tests.kube.operator_proc import CHART, OperatorProcess, start_operator

#: The hub example: a downloaded model pinned by digest, pre-pulled, placed by region (what these tests need).
EXAMPLE = yaml.safe_load((ROOT / "examples" / "embedding-hf.yaml").read_text())
DIGEST = "sha256:" + "ab" * 32
#: Leader election fast enough for tests of failover (the chart passes these to the operator); they pass it
#: themselves. A 3 s renew deadline can lapse on a loaded 2-core machine, whose API server is starved too, and
#: the operator then exits as its contract says; the other tests are not about that, and run with the chart's
#: own timing (`CHART_ELECTION`, release's default).
FAST_ELECTION = {"leaderElection.leaseDuration": "4", "leaderElection.renewDeadline": "3",
                 "leaderElection.retryPeriod": "1"}
CHART_ELECTION = {f"leaderElection.{key}": str(value)
                  for key, value in yaml.safe_load((CHART / "values.yaml").read_text())["leaderElection"].items()
                  if key in ("leaseDuration", "renewDeadline", "retryPeriod")}
HEARTBEATS = {"leases"}


def example(name: str, namespace: str, **spec_overrides: Any) -> dict[str, Any]:
    """examples/embedding-hf.yaml renamed into ``namespace``, with top-level spec blocks replaced."""
    doc = copy.deepcopy(EXAMPLE)
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"].update(copy.deepcopy(spec_overrides))
    return doc


def small(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """A minimal CPU EmbeddingDeployment (no pre-pull), autoscaling as given."""
    body = {"model": {"source": "hf://sentence-transformers/all-MiniLM-L6-v2", "digest": DIGEST},
            "runtime": {"image": "ghcr.io/embedfleet/runtime:0.1.0",
                        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}}
    body.update(copy.deepcopy(spec))
    return {"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


def condition(obj: dict[str, Any] | None, type_: str) -> str | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond.get("status")
    return None


def wait_condition(cluster: Cluster, name: str, namespace: str, type_: str, status: str = "True",
                   timeout: float = 90) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = cluster.get_json("embeddingdeployment", name, "-n", namespace)
        return obj if condition(obj, type_) == status else None

    return wait_until(check, timeout, f"{namespace}/{name} {type_}={status}")


def operator_writes(proc: OperatorProcess) -> list[str]:
    """The operator's writes since the mark, heartbeats (its Lease renewals) left out."""
    return [str(e) for e in proc.writes() if e.resource not in HEARTBEATS]


def remove_deployments(cluster: Cluster) -> None:
    """Every EmbeddingDeployment goes, even with no operator left to run its finalizer (a test that
    failed because the operator died): what is still there after the wait loses its finalizers, so that
    the next test on this control plane does not inherit it."""
    cluster.kubectl("delete", "embeddingdeployments", "--all", "-A", "--wait=true", "--timeout=60s",
                    check=False, timeout=90)
    left = (cluster.get_json("embeddingdeployments", "-A") or {}).get("items") or []
    for obj in left:
        meta = obj["metadata"]
        cluster.kubectl("patch", "embeddingdeployment", meta["name"], "-n", meta["namespace"], "--type=merge",
                        "-p", '{"metadata": {"finalizers": null}}', check=False)


@contextmanager
def release(cluster: Cluster, workdir: Path, tag: str, role: str = "standalone",
            sets: dict[str, str] | None = None, env: dict[str, str] | None = None,
            start: bool = True) -> Iterator[tuple[str, OperatorProcess | None]]:
    """`helm install` the chart (role's ci/ values) into its own namespace and run its operator.

    Yields (release namespace, operator). At exit: every EmbeddingDeployment the test left is deleted
    while the operator still runs (its finalizer), then the operator stops and the release goes."""
    namespace = f"ef-system-{tag}"
    name = f"ef-{tag}"
    values = [CHART / "ci" / f"{role}-values.yaml"]
    # No Prometheus URL (the spoke ci/ file names an in-cluster one): scrapes stay on this machine.
    all_sets = {**CHART_ELECTION, "prometheusUrl": "", **(sets or {})}
    # --skip-crds once they exist: another test may have updated them with kubectl, as the chart README
    # says, and helm's apply of crds/ would then conflict with kubectl's field manager.
    args = ["install", name, str(CHART), "-n", namespace, "--create-namespace", "--wait=false"]
    if cluster.get_json("crd", "embeddingdeployments.embedfleet.dev") is not None:
        args.append("--skip-crds")
    for path in values:
        args += ["-f", str(path)]
    for key, value in all_sets.items():
        args += ["--set", f"{key}={value}"]
    cluster.helm(*args)
    proc = None
    try:
        if start:
            proc = start_operator(cluster, workdir, release=name, namespace=namespace, values=values,
                                  sets=all_sets, env=env)
        yield namespace, proc
        if proc is not None and proc.alive():  # (a test may have killed it on purpose)
            cluster.kubectl("delete", "embeddingdeployments", "--all", "-A", "--wait=true", "--timeout=60s")
            code = proc.stop()
            # SIGTERM ends it promptly and cleanly: no backlog run while stopping, no orphaned timers.
            assert code == 0, f"the operator did not exit cleanly on SIGTERM (code {code}):\n{proc.log()[-2000:]}"
    finally:
        # Each step runs even if the one before raised: a release left installed keeps its admission
        # policy in force for every later test on this control plane (seen in CI: one test's dead
        # operator made two tenant tests fail).
        try:
            remove_deployments(cluster)
        finally:
            try:
                if proc is not None:
                    proc.stop()
            finally:
                cluster.helm("uninstall", name, "-n", namespace, "--wait=false", check=False)
