"""Shared fixtures for operator integration tests: a kmock Kubernetes emulator over real HTTP and a real
``kopf run`` operator process talking to it through a kubeconfig.

    def test_x(kmock_cluster, operator_process):
        operator_process(kmock_cluster.kubeconfig_path, {"EMBEDFLEET_STATUS_INTERVAL": "1"})
        kmock_cluster.create(EMBEDDING, "default", {...})
        wait_for(lambda: kmock_cluster.get("apps/v1/deployments", "default", "x"))

The emulator runs on its own event loop in a background thread; every read of its state goes through
`KmockCluster.call`, which runs on that loop, so tests never race the server. Objects are created and
changed through the real ``kubernetes`` client over HTTP, like ``kubectl`` would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kmock
import pytest
import yaml

from embedfleet.operator.kube import Kube, load_client

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

EMBEDDING = "embedfleet.dev/v1alpha1/embeddingdeployments"
MODEL_CACHE = "embedfleet.dev/v1alpha1/modelcaches"
VERBS = ["list", "watch", "get", "create", "update", "patch", "delete"]

#: Resource -> (kind, namespaced, subresources): what our operator and kopf touch.
#: kopf waits for v1/namespaces to be *discoverable* even when run with -A (it never lists them then,
#: which matters: kmock 0.8 crashes on GET /api/v1/namespaces), and watches CRDs for re-scans.
RESOURCES: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "v1/namespaces": ("Namespace", False, ()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ()),
    "v1/configmaps": ("ConfigMap", True, ()),
    "v1/services": ("Service", True, ()),
    "v1/serviceaccounts": ("ServiceAccount", True, ()),
    "v1/events": ("Event", True, ()),
    "v1/nodes": ("Node", False, ("status",)),
    "v1/pods": ("Pod", True, ("status",)),
    "apps/v1/deployments": ("Deployment", True, ("status", "scale")),
    "apps/v1/daemonsets": ("DaemonSet", True, ("status",)),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, ("status",)),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False, ()),
    EMBEDDING: ("EmbeddingDeployment", True, ("status", "scale")),
    MODEL_CACHE: ("ModelCache", True, ("status",)),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.2, what: str = "") -> T:
    """Poll until ``predicate()`` is truthy; return its value or fail naming what never happened."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what or predicate!r}; last value: {last!r}"
    )


@dataclass
class KmockCluster:
    """One emulated cluster: ``url``, ``kubeconfig_path``, the ``emulator`` and helpers to read it."""

    url: str
    kubeconfig_path: Path
    emulator: kmock.KubernetesEmulator
    loop: asyncio.AbstractEventLoop
    kube: Kube = field(init=False)

    def __post_init__(self) -> None:
        self.kube = Kube(load_client(self.kubeconfig_path))

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the emulator's loop (no concurrent mutation while it reads)."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        def read() -> dict[str, Any] | None:
            key = (kmock.resource(resource), namespace, name)
            if key not in self.emulator.objects or self.emulator.objects[key].deleted:
                return None
            return self.emulator.objects[key].raw

        return self.call(read)

    def names(self, resource: str, namespace: str | None = None) -> list[str]:
        def read() -> list[str]:
            return sorted(
                name
                for (res, ns, name), obj in self.emulator.objects.items()
                if res == kmock.resource(resource)
                and (namespace is None or ns == namespace)
                and not obj.deleted
            )

        return self.call(read)

    def requests(self) -> list[tuple[int, str, str, str | None, str | None]]:
        """(id, HTTP method, plural, namespace, name) of every request served so far."""

        def read() -> list[tuple[int, str, str, str | None, str | None]]:
            return [
                (r.id, str(r.method.value), r.resource.plural if r.resource else "", r.namespace, r.name)
                for r in list(self.emulator)
            ]

        return self.call(read)

    def create(self, resource: str, namespace: str, body: dict[str, Any]) -> None:
        """POST through the real client (the test's `kubectl apply`)."""
        kind = RESOURCES[resource][0]
        self.kube._request("POST", self.kube_kind(kind).path(namespace), body={**body, "kind": kind})

    def patch(
        self,
        resource: str,
        namespace: str | None,
        name: str,
        body: dict[str, Any],
        subresource: str | None = None,
    ) -> None:
        kind = RESOURCES[resource][0]
        self.kube.patch_merge(kind, name, namespace, body, subresource=subresource)

    def delete(self, resource: str, namespace: str, name: str) -> None:
        self.kube.delete(RESOURCES[resource][0], name, namespace)

    @staticmethod
    def kube_kind(kind: str) -> Any:
        from embedfleet.operator.kube import KINDS, Kind

        if kind in KINDS:
            return KINDS[kind]
        for resource, (k, namespaced, _) in RESOURCES.items():
            if k == kind:
                group_version, plural = resource.rsplit("/", 1)
                return Kind(group_version, plural, namespaced)
        raise KeyError(kind)


def _register(emulator: kmock.KubernetesEmulator) -> None:
    for resource, (kind, namespaced, subresources) in RESOURCES.items():
        emulator.resources[resource] = kmock.ResourceInfo(
            kind=kind,
            namespaced=namespaced,
            verbs=VERBS,
            subresources=subresources,
            singular=kind.lower(),
        )


def _write_kubeconfig(path: Path, url: str) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": url}}],
                "users": [{"name": "tester", "user": {"token": "kmock-does-not-check"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}],
                "current-context": "kmock",
            }
        )
    )


@pytest.fixture
def kmock_cluster(tmp_path: Path) -> Iterator[KmockCluster]:
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        holder["stop"] = stop
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator, port=free_port()) as server:
            _register(emulator)
            holder["emulator"], holder["url"] = emulator, str(server.url).rstrip("/")
            holder["loop"] = asyncio.get_running_loop()
            started.set()
            await stop.wait()

    def thread_main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:  # surfaced to the test below instead of dying silently
            holder["error"] = exc
            started.set()

    thread = threading.Thread(target=thread_main, name="kmock", daemon=True)
    thread.start()
    assert started.wait(30), "kmock emulator did not start"
    if "error" in holder:
        raise holder["error"]
    kubeconfig = tmp_path / "kubeconfig.yaml"
    _write_kubeconfig(kubeconfig, holder["url"])
    cluster = KmockCluster(holder["url"], kubeconfig, holder["emulator"], holder["loop"])
    try:
        yield cluster
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(10)


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    liveness_url: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture
def operator_process(tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    """Factory: ``operator_process(kubeconfig, extra_env=None, module=..., argv=None)`` runs ``kopf run -A``.

    ``argv`` replaces the command (``{liveness}`` in it is replaced by the liveness URL to serve), e.g.
    to start the operator through ``embedfleet operator run`` instead.

    Waits for kopf's liveness endpoint (it answers once the operator is up) and stops every started
    process at teardown; on a test failure the operator's log is printed.
    """
    started: list[OperatorProcess] = []

    def start(
        kubeconfig: Path,
        extra_env: dict[str, str] | None = None,
        module: str = "embedfleet.operator.handlers",
        argv: list[str] | None = None,
    ) -> OperatorProcess:
        port = free_port()
        liveness = f"http://127.0.0.1:{port}/healthz"
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "runtime", "client")),
            "HF_HUB_OFFLINE": "1",
            "EMBEDFLEET_STATUS_INTERVAL": "1",
            **(extra_env or {}),
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log_path = tmp_path / f"operator-{len(started)}.log"
        with log_path.open("wb") as log_file:
            command = [
                sys.executable,
                "-m",
                "kopf",
                "run",
                "-A",
                "--standalone",
                "--verbose",
                f"--liveness={liveness}",
                "-m",
                module,
            ]
            if argv is not None:
                command = [arg.replace("{liveness}", liveness) for arg in argv]
            process = subprocess.Popen(
                command,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
            )
        op = OperatorProcess(process, log_path, liveness)
        started.append(op)
        deadline = time.monotonic() + 60
        while not _alive(liveness):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"operator did not come up:\n{op.log()[-4000:]}")
            time.sleep(0.2)
        return op

    yield start
    for op in started:
        op.stop()
        # pytest shows captured output only for failing tests: the operator's own account of them.
        print(f"--- {op.log_path.name} (tail) ---\n{op.log()[-6000:]}")
