"""A fleet on the real test control plane: a hub and spokes, each its own kube-apiserver on one etcd, each
running the chart's operator as the chart's ServiceAccount, and readers for what they did (status, Events,
the audit log of every cluster).

The hub reaches each spoke with a kubeconfig for the identity the spoke's chart grants it (``hubAccess``:
ServiceAccount ``<fullname>-hub`` and ClusterRole/Role ``<fullname>-hub-access``), so a call of the hub loop
that the chart does not allow is a 403 in that spoke's audit log, and fails the test.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.gateway.conftest import GatewayServer
from tests.kube.controlplane import AuditEvent, Cluster, ControlPlane, wait_until
from tests.kube.fixtures import require_control_plane
from tests.kube.operator_proc import (
    BENIGN,
    CHART,
    OperatorProcess,
    is_kopf_patch_precondition,
    render_chart,
    start_operator,
)
from tests.procs import ROOT, child_env, free_port, spawn

SYSTEM = "embedfleet-system"
API = "embedfleet.dev/v1alpha1"
DIGEST = "sha256:" + "ab" * 32
#: Leader election relaxed enough for 2 busy cores (a spoke operator whose API server is gone for longer
#: than renewDeadline exits, as in a pod, and is restarted like the kubelet would).
ELECTION = {"leaderElection.leaseDuration": "8", "leaderElection.renewDeadline": "6",
            "leaderElection.retryPeriod": "1"}
#: Short intervals: hub round 1 s, heartbeat 1 s; the FleetCluster lease is 5 s + 5 s grace.
HUB_ENV = {"EMBEDFLEET_HUB_INTERVAL": "1", "EMBEDFLEET_HUB_RAMP_SECONDS": "6", "EMBEDFLEET_HUB_WRITE_TIMEOUT": "3",
           "EMBEDFLEET_HUB_CREDENTIALS_RECHECK": "2", "EMBEDFLEET_HUB_SECRET_RECHECK": "2"}
SPOKE_ENV = {"EMBEDFLEET_HEARTBEAT_INTERVAL": "1", "EMBEDFLEET_LEASE_DURATION": "5"}
LEASE = {"durationSeconds": 5, "graceSeconds": 5}
HEARTBEATS = {"leases"}


def hub_identity(spoke: str) -> str:
    """The hub's ServiceAccount on a spoke (and the name of its ClusterRole and Role, plus "-access")."""
    return f"ef-{spoke}-embedfleet-hub"


def hub_user(spoke: str) -> str:
    return f"system:serviceaccount:{SYSTEM}:{hub_identity(spoke)}"


def embedding(name: str, namespace: str, replicas: int, placement: dict[str, Any] | None = None,
              **spec: Any) -> dict[str, Any]:
    """A small CPU EmbeddingDeployment with a fixed replica count (autoscaling off)."""
    body: dict[str, Any] = {
        "model": {"source": "hf://sentence-transformers/all-MiniLM-L6-v2", "digest": DIGEST},
        "runtime": {"image": "ghcr.io/embedfleet/runtime:0.1.0",
                    "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
        "autoscaling": {"enabled": False},
        "replicas": replicas,
    }
    if placement is not None:
        body["placement"] = placement
    body.update(copy.deepcopy(spec))
    return {"apiVersion": API, "kind": "EmbeddingDeployment", "metadata": {"name": name, "namespace": namespace},
            "spec": body}


def errors(events: Iterable[AuditEvent], user: str, allow: Iterable[tuple[int, str]] = ()) -> list[str]:
    """4xx answers to `user` other than the benign ones and `allow` ((code, verb) or (code, resource))."""
    allowed = set(allow) | BENIGN
    return [str(e) for e in events if e.user == user and 400 <= e.code < 500 and not is_kopf_patch_precondition(e)
            and (e.code, e.verb) not in allowed and (e.code, e.resource) not in allowed]


@dataclass
class SpokeGateway:
    """A spoke's `embedfleet gateway --kubernetes`, run on the host as the chart runs it in a pod."""

    server: GatewayServer
    user: str  # its ServiceAccount, as the spoke's audit log names it
    argv: list[str]  # the chart's command and args, as started (port and hold time-out on loopback terms)


def writes(events: Iterable[AuditEvent], user: str) -> list[str]:
    """`user`'s writes, heartbeats (Lease renewals) left out."""
    return [str(e) for e in events if e.user == user and e.is_write and e.resource not in HEARTBEATS]


@dataclass
class Fleet:
    plane: ControlPlane
    workdir: Path
    hub: Cluster
    spokes: dict[str, Cluster]
    regions: dict[str, str]
    hub_proc: OperatorProcess | None = None
    spoke_procs: dict[str, OperatorProcess] = field(default_factory=dict)
    #: Extra chart values (``--set``) per cluster name ("hub" or a spoke's), e.g. its ``platform`` rules:
    #: used by install *and* start, so the admission policy and the operator enforce the same rules.
    values: dict[str, dict[str, str]] = field(default_factory=dict)
    gateways: dict[str, SpokeGateway] = field(default_factory=dict)
    #: The hub operator's environment over HUB_ENV's (a module that needs another write timeout).
    hub_env: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ setting up

    @classmethod
    def create(cls, plane: ControlPlane, workdir: Path, regions: dict[str, str],
               values: dict[str, dict[str, str]] | None = None) -> Fleet:
        """A hub (no nodes) and one spoke per region entry (two kwok CPU nodes each), charts installed (with
        ``values`` per cluster name) and every spoke joined; no operator started yet (callers add
        namespaces and policies first)."""
        hub = plane.add_cluster("hub", nodes=[], controllers=False)
        spokes = {name: plane.add_cluster(name, nodes=[{"name": f"{name}-cpu-{i}", "region": region}
                                                       for i in (1, 2)])
                  for name, region in regions.items()}
        fleet = cls(plane, workdir, hub, spokes, dict(regions), values=dict(values or {}))
        fleet.install(hub, "hub")
        for name, spoke in spokes.items():
            fleet.install(spoke, "spoke", regions[name])
        for name in spokes:
            fleet.join(name)
        return fleet

    def start(self) -> None:
        for name in self.spokes:
            self.start_spoke(name)
        self.start_hub()

    def install(self, cluster: Cluster, role: str, region: str = "") -> dict[str, str]:
        sets = {"role": role, **ELECTION}
        if region:
            sets["region"] = region
        sets.update(self.values.get(cluster.name, {}))
        args = ["install", f"ef-{cluster.name}", str(CHART), "-n", SYSTEM, "--create-namespace", "--wait=false"]
        if cluster.get_json("crd", "embeddingdeployments.embedfleet.dev") is not None:
            args.append("--skip-crds")  # (see tests/operator/real.py)
        for key, value in sets.items():
            args += ["--set", f"{key}={value}"]
        cluster.helm(*args)
        return sets

    def start_spoke(self, name: str) -> OperatorProcess:
        spoke = self.spokes[name]
        sets = {"role": "spoke", "region": self.regions[name], **ELECTION, **self.values.get(name, {})}
        proc = start_operator(spoke, self.workdir, release=f"ef-{name}", namespace=SYSTEM, sets=sets,
                              env=SPOKE_ENV, name=f"operator-{name}")
        self.spoke_procs[name] = proc
        return proc

    def start_hub(self) -> OperatorProcess:
        sets = {"role": "hub", **ELECTION, **self.values.get(self.hub.name, {})}
        self.hub_proc = start_operator(self.hub, self.workdir, release="ef-hub", namespace=SYSTEM, sets=sets,
                                       env={**HUB_ENV, **self.hub_env}, name="operator-hub")
        return self.hub_proc

    def join(self, name: str) -> None:
        """The spoke's kubeconfig (the hub's identity there) as a Secret on the hub, and its FleetCluster."""
        spoke = self.spokes[name]
        token = spoke.token_for(SYSTEM, hub_identity(name))
        path = spoke.kubeconfig_for(token, self.workdir / f"hub-on-{name}.kubeconfig", namespace=SYSTEM,
                                    user=hub_identity(name))
        self.hub.apply(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-kubeconfig", "namespace": SYSTEM},
             "data": {"kubeconfig": base64.b64encode(path.read_bytes()).decode()}},
            {"apiVersion": API, "kind": "FleetCluster", "metadata": {"name": name},
             "spec": {"provider": "test", "region": self.regions[name], "capacity": {"cpuReplicas": 10},
                      "connection": {"kubeconfigSecret": {"name": f"{name}-kubeconfig"}}, "lease": LEASE}},
        )

    def pod_range(self, spoke: str, cidr: str) -> None:
        """Every node of `spoke` a pod range of its own (kwok allocates from a node's podCIDR), set before any
        pod exists: each spoke's kwok would otherwise hand out the same addresses from netns.POD_CIDR."""
        for node in (self.spokes[spoke].get_json("nodes") or {}).get("items") or []:
            self.spokes[spoke].kubectl("patch", "node", node["metadata"]["name"], "--type=merge", "-p",
                                       json.dumps({"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}}))

    def start_gateway(self, spoke: str, hold_timeout: float) -> SpokeGateway:
        """`spoke`'s gateway as its chart renders it (command, args, ServiceAccount token) on a free loopback
        port, and that URL as the spoke's FleetCluster `spec.gatewayUrl`: where other regions' gateways
        spill to, once the hub names it on their copies. Stopped with the fleet."""
        cluster, port = self.spokes[spoke], free_port()
        sets = {"role": "spoke", "region": self.regions[spoke], **ELECTION, **self.values.get(spoke, {})}
        for doc in render_chart(cluster, f"ef-{spoke}", SYSTEM, sets=sets):
            labels = doc.get("metadata", {}).get("labels") or {}
            if doc.get("kind") == "Deployment" and labels.get("app.kubernetes.io/component") == "gateway":
                pod = doc["spec"]["template"]["spec"]
                break
        else:
            raise LookupError(f"the chart rendered no gateway Deployment for {spoke}")
        (container,) = pod["containers"]
        argv = [*container["command"], *container.get("args", [])]
        assert argv[:3] == ["embedfleet", "gateway", "--kubernetes"], argv
        argv = [sys.executable, "-m", "embedfleet.runtime.cli",
                *[a for a in argv[1:] if not a.startswith(("--port=", "--hold-timeout="))],
                "--host", "127.0.0.1", "--port", str(port), f"--hold-timeout={hold_timeout:g}"]
        account = pod["serviceAccountName"]
        kubeconfig = cluster.kubeconfig_for(cluster.token_for(SYSTEM, account),
                                            self.workdir / f"gateway-{spoke}.kubeconfig", namespace=SYSTEM,
                                            user=account)
        log_path = self.workdir / f"gateway-{spoke}.log"
        with open(log_path, "ab") as log:
            proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                         env=child_env({"KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                                        "KUBERNETES_SERVICE_HOST": None}))
        gateway = SpokeGateway(GatewayServer(proc, port, log_path), f"system:serviceaccount:{SYSTEM}:{account}", argv)
        self.gateways[spoke] = gateway
        gateway.server.wait_ready(timeout=120)  # 200 once its first lists are in
        self.hub.kubectl("patch", "fleetcluster", spoke, "--type=merge", "-p",
                         json.dumps({"spec": {"gatewayUrl": gateway.server.url}}))
        return gateway

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """A namespace on the hub (with the labels policies select on) and on every spoke."""
        for cluster in (self.hub, *self.spokes.values()):
            cluster.apply({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": dict(labels or {})}})

    def stop(self) -> None:
        for gateway in self.gateways.values():
            gateway.server.stop()
        for proc in [*self.spoke_procs.values(), self.hub_proc]:
            if proc is not None:
                proc.stop()

    # ------------------------------------------------------------------ reading

    def marks(self) -> None:
        for cluster in (self.hub, *self.spokes.values()):
            cluster.audit_mark()

    def operator_writes(self) -> list[str]:
        """Every operator's writes since the marks (the hub's on every cluster, each spoke's own), heartbeats
        left out."""
        found = writes(self.hub.audit(), self.hub_proc.user) if self.hub_proc is not None else []
        for name, spoke in self.spokes.items():
            events = spoke.audit()
            found += writes(events, hub_user(name))
            if self.spoke_procs.get(name) is not None:
                found += writes(events, self.spoke_procs[name].user)
        return found

    def wait_quiet(self, quiet: float = 3.0, timeout: float = 30.0) -> None:
        """Until no operator has written for `quiet` seconds (heartbeats aside): settled placement can still
        have status to report (a Deployment's controller marks it Available after its pods are Ready, later
        on a busy machine), and a steady-state window must start after that, not after a fixed sleep."""
        deadline = time.monotonic() + timeout
        while True:
            self.marks()
            time.sleep(quiet)
            found = self.operator_writes()
            if not found:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the operators kept writing for {timeout:.0f}s:\n" + "\n".join(found[-10:]))

    def hub_object(self, name: str, namespace: str) -> dict[str, Any]:
        return self.hub.get_json("embeddingdeployment", name, "-n", namespace) or {}

    def rows(self, name: str, namespace: str) -> dict[str, dict[str, Any]]:
        status = self.hub_object(name, namespace).get("status") or {}
        return {r["name"]: r for r in status.get("clusters") or []}

    def condition(self, name: str, namespace: str, type_: str) -> dict[str, Any]:
        for cond in (self.hub_object(name, namespace).get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return cond
        return {}

    def copy(self, spoke: str, name: str, namespace: str) -> dict[str, Any] | None:
        return self.spokes[spoke].get_json("embeddingdeployment", name, "-n", namespace)

    def copies(self, name: str, namespace: str) -> dict[str, int]:
        """spoke -> replicas of its copy, for spokes that have one."""
        out = {}
        for spoke in self.spokes:
            obj = self.copy(spoke, name, namespace)
            if obj is not None:
                out[spoke] = int(obj["spec"].get("replicas") or 0)
        return out

    def ready_pods(self, spoke: str, name: str, namespace: str) -> int:
        dep = self.spokes[spoke].get_json("deployment", name, "-n", namespace)
        return int(((dep or {}).get("status") or {}).get("readyReplicas") or 0)

    def events(self, name: str, namespace: str, reason: str) -> list[dict[str, Any]]:
        items = (self.hub.get_json("events", "-n", namespace) or {}).get("items") or []
        return [e for e in items if e["involvedObject"]["name"] == name and e.get("reason") == reason]

    def settled(self, name: str, namespace: str, shares: dict[str, int]) -> bool:
        """The hub reports `shares` placed, in place and ready, and the spokes run exactly them."""
        rows = self.rows(name, namespace)
        placed = self.condition(name, namespace, "Placed").get("status") == "True"
        healthy = self.condition(name, namespace, "Degraded").get("status") == "False"
        in_rows = {n: r.get("desired") for n, r in rows.items() if r.get("desired")}
        ready = all(rows.get(n, {}).get("ready") == k for n, k in shares.items())
        return (placed and healthy and in_rows == shares and ready and self.copies(name, namespace) == shares
                and all(self.ready_pods(s, name, namespace) == k for s, k in shares.items()))

    def wait_settled(self, name: str, namespace: str, shares: dict[str, int], timeout: float = 120) -> None:
        try:
            wait_until(lambda: self.settled(name, namespace, shares), timeout, f"{namespace}/{name} at {shares}",
                       interval=0.5)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nhub status: {self.hub_object(name, namespace).get('status')}\n"
                                 f"copies: {self.copies(name, namespace)}\n{self.logs()}") from exc

    def wait_failed_over(self, name: str, namespace: str, gone: str, to: str, replicas: int,
                         timeout: float = 60) -> None:
        """Until the hub reports `gone`'s share moved away (LeaseExpired) and `to` holding `replicas`."""
        def failed_over() -> bool:
            rows = self.rows(name, namespace)
            problem = (rows.get(gone) or {}).get("reasons", [""])[0]
            return (rows.get(to) or {}).get("desired") == replicas and \
                problem.startswith("problem: unavailable (LeaseExpired)")

        try:
            wait_until(failed_over, timeout, f"{namespace}/{name} failed over from {gone} to {to}", interval=0.5)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.hub_object(name, namespace).get('status')}\n{self.logs()}") from exc

    def logs(self, lines: int = 60) -> str:
        out = []
        for name, proc in [("hub", self.hub_proc), *self.spoke_procs.items()]:
            if proc is not None:
                tail = "\n".join(proc.log().splitlines()[-lines:])
                out.append(f"--- operator {name} (alive={proc.alive()})\n{tail}")
        return "\n".join(out)


@contextlib.contextmanager
def running_fleet(workdir: Path, regions: dict[str, str], values: dict[str, dict[str, str]] | None = None,
                  prepare: Callable[[Fleet], None] | None = None,
                  hub_env: dict[str, str] | None = None) -> Iterator[Fleet]:
    """A fleet on a control plane of its own (``Fleet.create``), ``prepare`` run before the operators start
    (namespaces, policies), every process stopped afterwards: a module fixture's whole body. ``hub_env``:
    the hub operator's environment over HUB_ENV's."""
    require_control_plane()
    plane = ControlPlane.start(workdir / "plane")
    fleet = None
    try:
        fleet = Fleet.create(plane, workdir, regions, values)
        fleet.hub_env = dict(hub_env or {})
        if prepare is not None:
            prepare(fleet)
        fleet.start()
        yield fleet
    finally:
        if fleet is not None:
            fleet.stop()
        plane.stop()
