"""Spot reclaim on the real test control plane: half of a deployment's replicas lose their spot node. One JSON
line, also appended to bench/results/spot-reclaim-cpu.jsonl.

A fresh control plane (tests/kube: etcd, kube-apiserver with RBAC and audit, controller-manager, scheduler,
kwok), on-demand kwok nodes and one spot node with room for one runtime pod, the chart installed (role
standalone) and the operator run as the chart runs it (its command, its ServiceAccount). An
EmbeddingDeployment of 2 replicas, autoscaling off, ``spot: {max: "50%"}``: one replica on demand, one on
spot. Behind every Running kwok pod a real ``embedfleet serve`` answers on the pod's IP inside a network
namespace (tests/kube/kubelet.py's stand-in kubelet), and a client sends embeddings requests through the
Service's ready endpoints (its EndpointSlices, re-read every 0.25 s, round robin) the whole time. Then the
reclaim signal: the spot node gets the ``embedfleet.dev/reclaim`` taint.

Figures (seconds from the taint, as the API server's audit log stamps it):
  on_demand_scaled_s        the operator's patch of the on-demand Deployment to 2 replicas (audit log)
  stand_in_serving_s        the stand-in's real runtime first seen answering /ready on its pod IP (polled)
  stand_in_ready_s          the stand-in pod marked Ready (`ReadinessRelay`: once its runtime answers /ready,
                            as a kubelet's readiness probe; kwok alone would mark it Ready when scheduled)
  spot_pod_evicted_s        the operator's eviction of the spot pod on the reclaimed node (audit log)
  evicted_after_stand_in_ready_s   the difference (>= 0: the stand-in served first)
  capacity_gap_s            how long fewer runtimes served than before the reclaim (0: never)
  requests / requests_failed   requests sent from 3 s before the taint to 5 s after the stand-in serves, and
                            those that did not get a 200 (a refused connection, which carries no request,
                            is retried on the next endpoint and counted in connect_retries, as a proxy or
                            the gateway does)

Needs root and the control plane built (scripts/kube-tools.sh). Usage: python bench/spot_reclaim.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "client")]

import httpx  # noqa: E402
import kubernetes  # noqa: E402
from tests.kube.background import Background, Poller  # noqa: E402
from tests.kube.controlplane import ControlPlane, kwok_stages, missing_reason, wait_until  # noqa: E402
from tests.kube.kubelet import RUNTIME_PORT, FakeKubelet  # noqa: E402
from tests.kube.netns import PodNetwork, unavailable_reason  # noqa: E402
from tests.operator.real import release, small  # noqa: E402

from _common import add_results_dir, record  # noqa: E402

ED = "reclaimed"
NS = "bench-spot"
SELECTOR = f"app.kubernetes.io/instance={ED},app.kubernetes.io/component=runtime"
SPOT_NODE = {"name": "spot-1", "cpu": "400m", "labels": {"embedfleet.dev/capacity-class": "spot"},
             "taints": [{"key": "embedfleet.dev/capacity-class", "value": "spot", "effect": "NoSchedule"}]}
NODES = [{"name": "cpu-1"}, {"name": "cpu-2"}, SPOT_NODE]
TEXT = "spot capacity comes and goes; the service stays"


#: kwok's pod-ready stage, but a runtime pod starts Running and not Ready: `ReadinessRelay` marks it Ready when
#: its runtime answers /ready, as a kubelet's readiness probe would (kwok alone marks pods Ready at once,
#: before any runtime could serve, and a reclaim would then seem to lose nothing).
UNREADY_RUNTIME = ('{{ if eq (printf "%v" (index .metadata.labels "app.kubernetes.io/component")) "runtime" }}'
                   '"False"{{ else }}"True"{{ end }}')


def kwok_config(tools: Path) -> str:
    text = kwok_stages(tools)
    for kind in ("Ready", "ContainersReady"):
        old = f'status: "True"\n        type: {kind}\n'
        assert text.count(old) == 1, f"kwok's pod-ready stage changed: {kind}"
        text = text.replace(old, f"status: {UNREADY_RUNTIME}\n        type: {kind}\n")
    return text


class ReadinessRelay(Poller):
    """A runtime pod turns Ready once its runtime answers /ready on the pod's IP (the stand-in kubelet's
    probe), never before."""

    every_s, wait_first = 0.2, True

    def __init__(self, cluster, kubelet: FakeKubelet) -> None:
        self.cluster, self.kubelet = cluster, kubelet
        #: pod name -> when it was marked Ready (wall clock, as the audit log's timestamps)
        self.marked: dict[str, float] = {}
        self.core = kubernetes.client.CoreV1Api(cluster.api_client())
        super().__init__()

    def poll(self) -> None:
        ready = {"status": {"conditions": [{"type": t, "status": "True"} for t in ("Ready", "ContainersReady")]}}
        serving = set(self.kubelet.ready_ips())
        for pod in self.core.list_namespaced_pod(NS, label_selector=SELECTOR).items:
            if pod.metadata.deletion_timestamp or pod.status.pod_ip not in serving:
                continue
            if not any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
                self.core.patch_namespaced_pod_status(pod.metadata.name, NS, ready)
                self.marked.setdefault(pod.metadata.name, time.time())


class Client(Background):
    """Embeddings requests, one at a time, round robin over the Service's ready endpoints."""

    threads, join_s = ("_refresh", "_send"), 40.0

    def __init__(self, api_client) -> None:
        self.discovery = kubernetes.client.DiscoveryV1Api(api_client)
        self.endpoints: list[str] = []
        self.sent = self.failed = self.connect_retries = 0
        self.failures: list[str] = []
        self.counting = False
        super().__init__()

    def _refresh(self) -> None:
        while not self.stopping.is_set():
            slices = self.discovery.list_namespaced_endpoint_slice(
                NS, label_selector=f"kubernetes.io/service-name={ED}").items
            self.endpoints = sorted(a for s in slices for e in s.endpoints or []
                                    if e.conditions and e.conditions.ready for a in e.addresses)
            self.stopping.wait(0.25)

    def _send(self) -> None:
        turn = itertools.count()
        with httpx.Client(timeout=30) as http:
            while not self.stopping.is_set():
                ips = list(self.endpoints)
                if not ips:
                    time.sleep(0.05)
                    continue
                ok, why, first = False, "", next(turn)
                for attempt in range(len(ips)):
                    ip = ips[(first + attempt) % len(ips)]
                    try:
                        resp = http.post(f"http://{ip}:{RUNTIME_PORT}/v1/embeddings", json={"input": [TEXT]})
                    except httpx.ConnectError as exc:
                        why = f"{ip}: {exc!r}"
                        if self.counting:
                            self.connect_retries += 1
                        continue
                    except httpx.HTTPError as exc:
                        why = f"{ip}: {exc!r}"
                        break
                    ok, why = resp.status_code == 200, f"{ip}: HTTP {resp.status_code}"
                    break
                if self.counting:
                    self.sent += 1
                    if not ok:
                        self.failed += 1
                        self.failures.append(why)


def measure(cluster, net: PodNetwork, workdir: Path) -> dict:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    with release(cluster, workdir, "bench") as (_system, proc):
        assert proc is not None
        cluster.kubectl("create", "namespace", NS)
        cluster.apply(small(ED, NS, replicas=2, autoscaling={"enabled": False},
                            spot={"max": "50%", "returnAfterSeconds": 5}))
        with FakeKubelet(cluster, net, NS, SELECTOR, workdir) as kubelet, ReadinessRelay(cluster, kubelet) as relay:
            def steady() -> bool:
                spot = ((cluster.get_json("ed", ED, "-n", NS) or {}).get("status") or {}).get("spot") or {}
                return (spot.get("serving") == 1 and spot.get("fallback") == 0 and spot.get("onDemand") == 1
                        and len(kubelet.ready_ips()) == 2)

            wait_until(steady, 300, "1 spot + 1 on-demand runtime serving, no stand-in", interval=1)
            pods = core.list_namespaced_pod(NS, label_selector=SELECTOR).items
            doomed = next(p for p in pods if p.spec.node_name == SPOT_NODE["name"])
            before = set(kubelet.ready_ips())
            known = {p.metadata.name for p in pods}
            with Client(cluster.api_client()) as client:
                wait_until(lambda: len(client.endpoints) == 2, 30, "the client sees both endpoints")
                client.counting = True
                time.sleep(3)
                cluster.audit_mark()
                asked = time.time()
                cluster.kubectl("taint", "node", SPOT_NODE["name"], "embedfleet.dev/reclaim=true:NoSchedule")
                tainted = next((e.received for e in cluster.audit() if e.user == "admin" and e.verb == "patch"
                                and e.resource == "nodes" and e.name == SPOT_NODE["name"]), asked)
                marks: dict[str, float] = {}
                gap_from: float | None = None
                gap = 0.0
                while time.time() - tainted < 300 and len(marks) < 4:
                    now = time.time()
                    serving = set(kubelet.ready_ips())
                    if "stand_in_serving_s" not in marks and serving - before:
                        marks["stand_in_serving_s"] = now - tainted
                    stand_ins = [t for name, t in relay.marked.items() if name not in known and t > tainted]
                    if stand_ins and "stand_in_ready_s" not in marks:
                        marks["stand_in_ready_s"] = min(stand_ins) - tainted
                    evicted = [e.received for e in proc.requests() if e.subresource == "eviction"
                               and e.name == doomed.metadata.name and e.code < 300]
                    if evicted and "spot_pod_evicted_s" not in marks:
                        marks["spot_pod_evicted_s"] = evicted[0] - tainted
                    scaled = [e.received for e in proc.writes() if e.resource == "deployments" and e.name == ED]
                    if scaled and "on_demand_scaled_s" not in marks:
                        marks["on_demand_scaled_s"] = scaled[0] - tainted
                    if len(serving) < len(before):
                        gap_from = now if gap_from is None else gap_from
                    elif gap_from is not None:
                        gap, gap_from = gap + now - gap_from, None
                    time.sleep(0.1)
                if gap_from is not None:
                    gap += time.time() - gap_from
                time.sleep(5)
                client.counting = False
            evictions = [str(e) for e in proc.requests() if e.subresource == "eviction"]
            status = ((cluster.get_json("ed", ED, "-n", NS) or {}).get("status") or {}).get("spot")
            errors = [str(e) for e in proc.unexpected_errors()]
    return {
        **{k: round(v, 2) for k, v in sorted(marks.items(), key=lambda kv: kv[1])},
        "evicted_after_stand_in_ready_s": round(marks["spot_pod_evicted_s"] - marks["stand_in_ready_s"], 2)
        if {"spot_pod_evicted_s", "stand_in_ready_s"} <= marks.keys() else None,
        "capacity_gap_s": round(gap, 2),
        "requests": client.sent,
        "requests_failed": client.failed,
        "connect_retries": client.connect_retries,
        "failures": client.failures[:5],
        "evictions": evictions,
        "status_spot_after": status,
        "operator_unexpected_errors": errors,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_dir(parser, "spot-reclaim-cpu.jsonl")
    args = parser.parse_args()
    reason = missing_reason() or unavailable_reason()
    if reason:
        print(json.dumps({"bench": "spot_reclaim", "skipped": reason}))
        return 0
    load = round(os.getloadavg()[0], 2)
    workdir = Path(tempfile.mkdtemp(prefix="embedfleet-bench-"))
    plane = ControlPlane.start(workdir)
    net = PodNetwork.create()
    try:
        cluster = plane.add_cluster("bench", nodes=NODES, kwok_config=kwok_config(plane.tools))
        result = measure(cluster, net, workdir)
    finally:
        net.delete()
        plane.stop()
    row = {"bench": "spot_reclaim", "replicas": 2, "reclaimed": 1, "cpus": os.cpu_count(), "loadavg_1m_at_start": load,
           "readiness": "a runtime pod is Ready once its real runtime answers /ready on the pod IP", **result}
    print(json.dumps(row))
    record("spot-reclaim", row, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
