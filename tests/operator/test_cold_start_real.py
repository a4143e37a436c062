"""Cold starts on a real API server: the chart's operator (its command, its ServiceAccount) reports each new
runtime pod's first Ready once, as a ColdStart Event on its EmbeddingDeployment naming the pod and the
pod-visible phases, and as ``embedfleet_cold_start_seconds{phase}`` on its /metrics.

kwok runs no container, so no runtime answers GET /load at the pods' IPs: the Events say the runtime's
own phases were not read (tests/runtime/test_cold_start.py reads them from a real runtime). A pod that
changes again, and an operator that sees Ready pods when it starts, report nothing more; a pod that
replaces a deleted one is new and is reported.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from tests.kube.controlplane import Cluster, wait_until
from tests.operator.real import release, small, wait_condition
from tests.operator.test_operator_metrics_real import scrape, value
from tests.procs import free_port

from embedfleet.operator.cold_start import POD_PHASES

NAME = "cold"
MESSAGE = re.compile(r"^pod (?P<pod>\S+) Ready (?P<total>[\d.]+)s after creation: (?P<phases>.*); "
                     r"runtime phases not read \(the pod did not answer GET /load\)$")


def cold_start_events(cluster: Cluster, ns: str) -> list[dict]:
    events = cluster.get_json("events", "-n", ns, "--field-selector",
                              f"involvedObject.kind=EmbeddingDeployment,involvedObject.name={NAME},reason=ColdStart")
    return (events or {}).get("items") or []


def pods(cluster: Cluster, ns: str) -> dict[str, dict]:
    items = cluster.get_json("pods", "-n", ns, "-l", f"embedfleet.dev/deployment={NAME}")["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def ready_pods(cluster: Cluster, ns: str, count: int) -> dict[str, dict]:
    def check() -> dict[str, dict] | None:
        found = pods(cluster, ns)
        ready = {n: p for n, p in found.items()
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}
        return ready if len(ready) == count else None
    return wait_until(check, 60, f"{count} Ready runtime pods")


def seconds_between(pod: dict, condition: str) -> int:
    at = next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c["type"] == condition)
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return int((parse(at) - parse(pod["metadata"]["creationTimestamp"])).total_seconds())


def check_events(cluster: Cluster, ns: str, expected: dict[str, dict]) -> None:
    """One ColdStart Event per pod, naming every pod-visible phase, their sum the pod's creation -> Ready."""
    events = cold_start_events(cluster, ns)
    by_pod: dict[str, list[re.Match]] = {}
    for event in events:
        assert event["type"] == "Normal" and event["involvedObject"]["kind"] == "EmbeddingDeployment"
        match = MESSAGE.match(event["message"])
        assert match, event["message"]
        by_pod.setdefault(match["pod"], []).append(match)
    assert {name: len(found) for name, found in by_pod.items()} == {name: 1 for name in expected}
    for name, (match,) in by_pod.items():
        phases = dict(part.rsplit(" ", 1) for part in match["phases"].split(", "))
        assert list(phases) == list(POD_PHASES), match["phases"]  # kwok writes every condition the kubelet does
        seconds = [float(v.removesuffix("s")) for v in phases.values()]
        assert all(s >= 0 for s in seconds)
        # each figure is rounded to a tenth (whole seconds from 10 s): the sum within that of the total
        assert abs(sum(seconds) - float(match["total"])) <= 0.05 * (len(seconds) + 1) + 1e-9, match.group(0)
        # the operator times what its watch saw happen (sub-second, its own clock); the Pod's timestamps are
        # whole seconds: the two agree within a second, plus the watch's delivery and kopf's 0.1 s batching
        assert abs(float(match["total"]) - seconds_between(expected[name], "Ready")) <= 1.5, match.group(0)


def test_each_new_pod_is_reported_once(kube_cluster: Cluster, unique: str, tmp_path: Path) -> None:
    port = free_port()
    with release(kube_cluster, tmp_path, unique, env={"EMBEDFLEET_OPERATOR_METRICS_PORT": str(port)}) \
            as (_system, proc):
        assert proc is not None
        ns = f"team-{unique}"
        kube_cluster.kubectl("create", "namespace", ns)
        kube_cluster.apply(small(NAME, ns, autoscaling={"enabled": False}, replicas=2))
        wait_condition(kube_cluster, NAME, ns, "Available")
        first = ready_pods(kube_cluster, ns, 2)
        wait_until(lambda: len(cold_start_events(kube_cluster, ns)) >= 2 or None, 30, "two ColdStart Events")
        check_events(kube_cluster, ns, first)

        def counted(n: int) -> bool | None:
            samples = scrape(port)
            return all(value(samples, "embedfleet_cold_start_seconds_count", phase=p) == n for p in POD_PHASES) \
                or None
        wait_until(lambda: counted(2), 30, "two cold starts on the operator's /metrics")

        # a change to a Ready pod is no new cold start
        touched = sorted(first)[0]
        kube_cluster.kubectl("label", "pod", touched, "-n", ns, "touched=yes")
        # a replacement pod is one
        gone = sorted(first)[1]
        kube_cluster.kubectl("delete", "pod", gone, "-n", ns, "--wait=true")
        now = wait_until(lambda: (lambda p: p if gone not in p and len(p) == 2 else None)(ready_pods(
            kube_cluster, ns, 2)), 60, "the replacement pod Ready")
        wait_until(lambda: len(cold_start_events(kube_cluster, ns)) >= 3 or None, 30, "the replacement's Event")
        check_events(kube_cluster, ns, {**first, **now})
        wait_until(lambda: counted(3), 30, "three cold starts on the operator's /metrics")
        assert proc.alive(), proc.log()[-3000:]
        errors = proc.unexpected_errors()
        assert errors == [], "\n".join(map(str, errors))
        assert len(cold_start_events(kube_cluster, ns)) == 3  # the label changed nothing
