"""Spot capacity with on-demand fallback on the real control plane (docs/spot.md), with the operator as the
chart runs it (its command, its ServiceAccount) and the audit log read at the end.

kwok nodes: the session's on-demand ones (cpu-*, gpu-*: no spot label) and spot ones of this test, labelled
``embedfleet.dev/capacity-class=spot`` and tainted as a spot pool is, each with room for one runtime pod (400m
CPU for a pod that asks 250m), so a spot replica that loses its node has nowhere to go until a new spot node comes.

An EmbeddingDeployment of 4 replicas (autoscaling off) with ``spot: {max: "50%", returnAfterSeconds: 2}``:

- steady: 2 spot pods on spot nodes only, 2 on-demand pods on non-spot nodes only, status.spot 2/2/0;
- reclaim (the reclaim taint on a spot node): a stand-in on demand (3 on-demand, fallback 1), a SpotFallback
  Event naming the node, and the spot pod there evicted only once the stand-in is Ready, so the Ready pods
  never drop below the 4 asked for;
- return (a new spot node): the pending spot pod runs there, and returnAfterSeconds later the stand-in goes
  (2 on-demand, fallback 0) with a SpotReturned Event;
- ``fallback: none``: a spot node deleted outright, its pod evicted, and no stand-in (on-demand stays 2).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.kube.background import Poller
from tests.kube.controlplane import AuditEvent, Cluster, wait_until
from tests.kube.operator_proc import OperatorProcess
from tests.operator.real import operator_writes, release, small
from tests.operator.test_operator_metrics_real import scrape, value
from tests.procs import free_port

from embedfleet.operator.spot import CAPACITY_LABEL

ED = "spotty"
SELECTOR = f"app.kubernetes.io/instance={ED},app.kubernetes.io/component=runtime"
SPOT_LABEL = ("embedfleet.dev/capacity-class", "spot")
SPOT_TAINT = {"key": SPOT_LABEL[0], "value": SPOT_LABEL[1], "effect": "NoSchedule"}
RECLAIM_TAINT = "embedfleet.dev/reclaim=true:NoSchedule"
RETURN_AFTER_S = 2
#: Room for one runtime pod (it requests 250m CPU: its init container's, the larger request).
SPOT_NODE_CPU = "400m"


def spot_node(name: str) -> dict[str, Any]:
    return {"name": name, "cpu": SPOT_NODE_CPU, "labels": dict([SPOT_LABEL]), "taints": [SPOT_TAINT]}


@contextmanager
def spot_nodes(cluster: Cluster, names: list[str]) -> Iterator[Callable[[str], None]]:
    """These spot nodes now, and any added with the yielded function; all deleted at exit (the session's
    cluster outlives this test)."""
    added: list[str] = []

    def add(name: str) -> None:
        added.append(name)
        cluster.add_nodes([spot_node(name)])

    try:
        for name in names:
            add(name)
        yield add
    finally:
        cluster.kubectl("delete", "nodes", *added, "--ignore-not-found", "--wait=false", check=False)


def _ready(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions") or [])


def _is_spot(pod: dict[str, Any]) -> bool:
    return pod["metadata"].get("labels", {}).get(CAPACITY_LABEL) == "spot"


def _pods(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    return (cluster.get_json("pods", "-n", ns, "-l", SELECTOR) or {}).get("items") or []


def _spot_status(cluster: Cluster, ns: str) -> dict[str, Any]:
    return ((cluster.get_json("embeddingdeployment", ED, "-n", ns) or {}).get("status") or {}).get("spot") or {}


def _deployment(cluster: Cluster, name: str, ns: str) -> tuple[int | None, int]:
    """(spec.replicas, status.readyReplicas) of one Deployment."""
    obj = cluster.get_json("deployment", name, "-n", ns) or {}
    return (obj.get("spec") or {}).get("replicas"), int((obj.get("status") or {}).get("readyReplicas") or 0)


def _events(cluster: Cluster, ns: str, reason: str) -> dict[str, str]:
    """uid -> message of the EmbeddingDeployment's Events with this reason."""
    items = cluster.get_json("events", "-n", ns, "--field-selector",
                             f"involvedObject.name={ED},involvedObject.kind=EmbeddingDeployment")["items"]
    return {e["metadata"]["uid"]: e.get("message", "") for e in items if e.get("reason") == reason}


def _status_is(cluster: Cluster, ns: str, **want: Any) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        got = _spot_status(cluster, ns)
        return got if all(got.get(k) == v for k, v in want.items()) else None

    return check


def operator_writes_of(proc: OperatorProcess, resource: str, name: str) -> list[AuditEvent]:
    return [e for e in proc.writes() if e.resource == resource and e.name == name and e.code < 300]


class ReadyFloor(Poller):
    """Samples the deployment's Ready pods (not terminating) in a thread: the fewest seen, and when."""

    every_s = 0.1

    def __init__(self, cluster: Cluster, ns: str) -> None:
        from kubernetes import client

        self.api = client.CoreV1Api(cluster.api_client())
        self.ns = ns
        self.low: tuple[int, list[str]] | None = None
        self.samples = 0
        super().__init__()

    def poll(self) -> None:
        pods = self.api.list_namespaced_pod(self.ns, label_selector=SELECTOR).to_dict()["items"]
        ready = [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletion_timestamp")
                 and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
        if self.low is None or len(ready) < self.low[0]:
            self.low = (len(ready), ready)
        self.samples += 1


def test_spot_replicas_fall_back_on_demand_when_reclaimed_and_return(
        kube_cluster: Cluster, unique: str, tmp_path: Path) -> None:
    cluster = kube_cluster
    nodes = [f"spot-{unique}-{i}" for i in (1, 2, 3)]
    port = free_port()
    with release(cluster, tmp_path, unique, env={"EMBEDFLEET_OPERATOR_METRICS_PORT": str(port)}) as (_system, proc), \
            spot_nodes(cluster, nodes[:2]) as add_spot_node:
        assert proc is not None
        ns = f"spot-{unique}"
        cluster.kubectl("create", "namespace", ns)
        cluster.apply(small(ED, ns, replicas=4, autoscaling={"enabled": False},
                            spot={"max": "50%", "returnAfterSeconds": RETURN_AFTER_S}))

        def diagnose() -> str:
            pods = [(p["metadata"]["name"], p["spec"].get("nodeName"), _ready(p)) for p in _pods(cluster, ns)]
            return f"\nstatus.spot: {_spot_status(cluster, ns)}\npods: {pods}\n{proc.log()[-3000:]}"

        # (a) steady state: each side on its own nodes, the split 2 + 2 with no stand-ins
        try:
            wait_until(_status_is(cluster, ns, total=4, spot=2, onDemand=2, serving=2, fallback=0, reclaimed=[]),
                       120, "status.spot 2 spot + 2 on demand")
            wait_until(lambda: _deployment(cluster, ED, ns) == (2, 2) and _deployment(cluster, f"{ED}-spot", ns)
                       == (2, 2), 60, "both Deployments at 2 Ready")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}{diagnose()}") from exc
        pods = _pods(cluster, ns)
        spot_pods = {p["spec"]["nodeName"]: p["metadata"]["name"] for p in pods if _is_spot(p)}
        on_demand = [p["spec"]["nodeName"] for p in pods if not _is_spot(p)]
        assert sorted(spot_pods) == nodes[:2], diagnose()
        assert len(on_demand) == 2 and not set(on_demand) & set(nodes), diagnose()
        for node in on_demand:  # an on-demand node, not merely one of other names
            labels = cluster.get_json("node", node)["metadata"]["labels"]
            assert labels.get(SPOT_LABEL[0]) != SPOT_LABEL[1], (node, labels)

        # (b) reclaim: a stand-in on demand first, then the spot pod there is evicted
        reclaimed, doomed = nodes[0], spot_pods[nodes[0]]
        fallbacks = _events(cluster, ns, "SpotFallback")
        with ReadyFloor(cluster, ns) as floor:
            cluster.kubectl("taint", "node", reclaimed, RECLAIM_TAINT)
            try:
                wait_until(_status_is(cluster, ns, total=4, spot=2, onDemand=3, fallback=1), 30,
                           "status.spot with one stand-in")
                wait_until(lambda: _deployment(cluster, ED, ns) == (3, 3), 60, "3 on-demand replicas Ready")
                wait_until(lambda: all(p["metadata"]["name"] != doomed for p in _pods(cluster, ns)), 60,
                           f"the spot pod {doomed} evicted")
                # its replacement has no spot node with room: pending, so the stand-in stays
                wait_until(_status_is(cluster, ns, onDemand=3, fallback=1, serving=1, reclaimed=[]), 30,
                           "status.spot after the drain")
            except TimeoutError as exc:
                raise AssertionError(f"{exc}{diagnose()}") from exc
        assert floor.samples >= 10 and floor.low is not None and floor.low[0] >= 4, (floor.low, floor.samples)
        news = {u: m for u, m in _events(cluster, ns, "SpotFallback").items() if u not in fallbacks}
        assert len(news) == 1 and reclaimed in next(iter(news.values())), news  # said once, naming the node
        assert "taint embedfleet.dev/reclaim" in next(iter(news.values())), news
        evictions = [e for e in proc.requests() if e.subresource == "eviction" and e.verb == "create"]
        assert [(e.name, e.code) for e in evictions] == [(doomed, 201)], [str(e) for e in evictions]
        assert _deployment(cluster, ED, ns) == (3, 3) and _deployment(cluster, f"{ED}-spot", ns)[0] == 2
        # the operator's /metrics says the same, summed over its spot deployments (this is its only one)
        samples = scrape(port)
        assert value(samples, "embedfleet_operator_spot_replicas", state="asked") == 2, samples
        assert value(samples, "embedfleet_operator_spot_replicas", state="serving") == 1
        assert value(samples, "embedfleet_operator_spot_replicas", state="stand_in") == 1
        assert value(samples, "embedfleet_operator_spot_evictions_total") == 1
        assert value(samples, "embedfleet_operator_spot_reclaimed_pods_total") == 1

        # (c) spot capacity returns: the pending spot pod runs, and the stand-in goes after returnAfterSeconds
        returned = _events(cluster, ns, "SpotReturned")
        add_spot_node(nodes[2])
        back = wait_until(lambda: next((p["metadata"]["name"] for p in _pods(cluster, ns) if _is_spot(p)
                                        and p["spec"].get("nodeName") == nodes[2] and _ready(p)), None),
                          60, f"a spot pod Ready on {nodes[2]}")
        try:
            wait_until(_status_is(cluster, ns, total=4, spot=2, onDemand=2, serving=2, fallback=0), 30,
                       "the stand-in released")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}{diagnose()}") from exc
        wait_until(lambda: _deployment(cluster, ED, ns) == (2, 2), 60, "on demand back to 2")
        # not before the spot pod had served for returnAfterSeconds (less one tick of the daemon), by the API
        # server's clock: kwok's status write that made it Ready, and the operator's scale-down
        audit = cluster.audit()
        ready_at = min(e.received for e in audit if e.resource == "pods" and e.subresource == "status"
                       and e.name == back and e.verb in ("patch", "update") and e.user_agent.startswith("kwok"))
        scaled_down = min(e.received for e in operator_writes_of(proc, "deployments", ED) if e.received > ready_at)
        assert scaled_down - ready_at >= RETURN_AFTER_S - 1.0, (scaled_down - ready_at)
        wait_until(lambda: {u: m for u, m in _events(cluster, ns, "SpotReturned").items() if u not in returned},
                   30, "a SpotReturned Event")
        news = {u: m for u, m in _events(cluster, ns, "SpotReturned").items() if u not in returned}
        assert len(news) == 1, news
        pods = _pods(cluster, ns)
        assert sorted(p["spec"]["nodeName"] for p in pods if _is_spot(p)) == [nodes[1], nodes[2]], diagnose()
        errors = proc.unexpected_errors()
        assert errors == [], "\n".join(map(str, errors)) + "\n" + proc.log()[-3000:]

        # steady again: the spot daemon (a tick a second) writes nothing
        time.sleep(RETURN_AFTER_S + 1)
        cluster.audit_mark()
        time.sleep(8)
        assert operator_writes(proc) == []

        # (d) fallback none: a spot node deleted, its pod evicted, and no stand-in
        cluster.kubectl("patch", "embeddingdeployment", ED, "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"spot": {"fallback": "none"}}}))
        fallbacks = _events(cluster, ns, "SpotFallback")
        gone = nodes[1]
        doomed = next(p["metadata"]["name"] for p in pods if p["spec"].get("nodeName") == gone)
        time.sleep(2)  # the daemon's next tick reads the patched spec
        cluster.kubectl("delete", "node", gone, "--wait=false")
        try:
            wait_until(lambda: any(e.subresource == "eviction" and e.name == doomed for e in proc.requests()), 30,
                       f"the eviction of {doomed}")
            wait_until(_status_is(cluster, ns, total=4, spot=2, onDemand=2, fallback=0), 30, "no stand-in")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}{diagnose()}") from exc

        time.sleep(RETURN_AFTER_S + 1)
        assert _deployment(cluster, ED, ns)[0] == 2, diagnose()
        assert _spot_status(cluster, ns).get("fallback") == 0, diagnose()
        news = {u: m for u, m in _events(cluster, ns, "SpotFallback").items() if u not in fallbacks}
        assert news == {}, news

        # (e) spec.spot removed: the spot Deployment goes, the on-demand one runs them all, status.spot is cleared
        cluster.kubectl("patch", "embeddingdeployment", ED, "-n", ns, "--type=json",
                        "-p", json.dumps([{"op": "remove", "path": "/spec/spot"}]))
        try:
            wait_until(lambda: cluster.get_json("deployment", f"{ED}-spot", "-n", ns) is None, 30,
                       "the spot Deployment deleted")
            wait_until(lambda: _deployment(cluster, ED, ns)[0] == 4, 30, "4 replicas on demand")
            wait_until(lambda: "spot" not in (cluster.get_json("embeddingdeployment", ED, "-n", ns) or {})
                       .get("status", {}), 30, "status.spot cleared")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}{diagnose()}") from exc

        errors = proc.unexpected_errors()
        assert errors == [], "\n".join(map(str, errors)) + "\n" + proc.log()[-3000:]
