"""A stand-in kubelet: kwok runs no containers, so this starts one real `embedfleet serve` (the embedded
model) per Running pod, listening on that pod's IP inside the test's network namespace (netns.py), and
stops it when the pod is being deleted or gone.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.kube.background import Poller
from tests.kube.controlplane import Cluster
from tests.kube.netns import PodNetwork
from tests.procs import ROOT, child_env, spawn, stop_process

#: The runtime's port (the EmbeddingDeployment default, which its Service and EndpointSlice name).
RUNTIME_PORT = 8080
#: Passed even without `config_env`: a gateway pins requests to the vector space the operator rendered
#: for the pod, and a runtime started without it would (rightly) refuse them.
IDENTITY_ENV = ("EMBEDFLEET_REVISION", "EMBEDFLEET_VECTOR_SPACE")


class FakeKubelet(Poller):
    """Starts one real runtime per Running pod IP (and stops it when the pod goes)."""

    every_s, wait_first, join_s = 0.5, True, 30.0

    def __init__(self, cluster: Cluster, net: PodNetwork, namespace: str, selector: str, logs: Path,
                 config_env: bool = False, keep_env: tuple[str, ...] = IDENTITY_ENV) -> None:
        self.cluster, self.net, self.namespace, self.selector, self.logs = cluster, net, namespace, selector, logs
        #: Start each runtime with the EMBEDFLEET_* variables of its pod (the ConfigMaps its container's
        #: envFrom names, then its env values) as a kubelet would, instead of the embedded default model.
        self.config_env = config_env
        #: Without `config_env`, the pod's variables the runtime still gets (add EMBEDFLEET_SERVED_MODEL_NAME
        #: where the gateway routes by a name other than the embedded model's).
        self.keep_env = keep_env
        self.runtimes: dict[str, subprocess.Popen] = {}
        #: The uid of the pod each runtime was started for: kwok hands a freed IP to the next pod, and a
        #: runtime left from the previous pod on that IP would answer with the wrong model and revision.
        self.owners: dict[str, str] = {}
        #: IPs whose runtime outlives its pod until the test stops it with `stop` (a slow shutdown).
        self.lingering: set[str] = set()
        self._lock = threading.Lock()
        super().__init__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        with self._lock:
            for proc in self.runtimes.values():
                stop_process(proc)
            self.runtimes.clear()

    def poll(self) -> None:
        pods = self.cluster.get_json("pods", "-n", self.namespace, "-l", self.selector) or {"items": []}
        running = {p["status"].get("podIP"): p for p in pods["items"]
                   if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")}
        running.pop(None, None)
        live = set(running)
        with self._lock:
            reused = {ip for ip in live & set(self.runtimes) - self.lingering
                      if self.owners.get(ip) != running[ip]["metadata"].get("uid")}
            for ip in reused:
                stop_process(self.runtimes.pop(ip))
        envs = {ip: self.pod_env(pod) for ip, pod in running.items() if ip not in self.runtimes}
        with self._lock:
            if self.stopping.is_set():
                return
            for ip in live - set(self.runtimes):
                env = envs.get(ip)
                if env is None:
                    continue  # its ConfigMap could not be read yet: try again next round
                if not self.config_env:  # the embedded model, but the pod's revision identity (pinning)
                    env = {k: v for k, v in env.items() if k in self.keep_env}
                with open(self.logs / f"runtime-{ip}.log", "ab") as log:
                    self.runtimes[ip] = spawn(
                        [*self.net.prefix(), sys.executable, "-m", "embedfleet.runtime.cli", "serve",
                         "--host", ip, "--port", str(RUNTIME_PORT), "--max-concurrent-requests", "256"],
                        stdout=log, stderr=log, env=child_env(env), cwd=ROOT,
                    )
                self.owners[ip] = running[ip]["metadata"].get("uid", "")
            for ip in set(self.runtimes) - live - self.lingering:
                stop_process(self.runtimes.pop(ip))

    def pod_env(self, pod: dict) -> dict[str, str | None] | None:
        """The EMBEDFLEET_* / OTEL_* environment the pod's first container would get (envFrom ConfigMaps,
        then env values), less the listen address (the pod IP and port are given as flags); None while a
        ConfigMap it names cannot be read."""
        container = pod["spec"]["containers"][0]
        env: dict[str, str | None] = {}
        for source in container.get("envFrom") or []:
            ref = (source.get("configMapRef") or {}).get("name")
            if not ref:
                continue
            config = self.cluster.get_json("configmap", ref, "-n", self.namespace)
            if not config:
                return None
            env.update(config.get("data") or {})
        env.update({e["name"]: e["value"] for e in container.get("env") or [] if "value" in e})
        wanted = {k: v for k, v in env.items() if k.startswith(("EMBEDFLEET_", "OTEL_"))}
        for name in ("EMBEDFLEET_HOST", "EMBEDFLEET_PORT"):
            wanted.pop(name, None)
        return wanted

    def stop(self, ip: str) -> None:
        """Stop the runtime on `ip` now (one left lingering after its pod went, say)."""
        with self._lock:
            self.lingering.discard(ip)
            proc = self.runtimes.pop(ip, None)
        if proc is not None:
            stop_process(proc)

    def ready_ips(self) -> list[str]:
        out = []
        for ip in list(self.runtimes):
            try:
                if httpx.get(f"http://{ip}:{RUNTIME_PORT}/ready", timeout=2).status_code == 200:
                    out.append(ip)
            except httpx.HTTPError:
                pass
        return out
