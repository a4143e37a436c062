"""A real Kubernetes control plane for tests: etcd, kube-apiserver (RBAC, audit log, service-account
tokens), kube-controller-manager, kube-scheduler and kwok fake nodes, all on loopback.

Built once per machine by ``scripts/kube-tools.sh`` (from the Go modules; see shared/DESIGN.md). Several
API servers may share one etcd, each with its own ``--etcd-prefix``: each is a separate cluster (hub and
spokes). Every process runs in its own session and is killed by PID at teardown, SIGKILL after a grace
period: an apiserver whose etcd went first may ignore SIGTERM.

    plane = ControlPlane.start(tmp)           # etcd only
    cluster = plane.add_cluster("c1", nodes=[cpu_node("n1"), gpu_node("g1")])
    cluster.kubectl("get", "nodes")
    token = cluster.token_for("embedfleet-system", "embedfleet")
    plane.stop()
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tests.kube.netns import POD_CIDR, guard_pod_range, unavailable_reason
from tests.procs import free_port
from tests.procs import spawn as spawn_child  # own session; dies with pytest

ROOT = Path(__file__).resolve().parents[2]
KUBE_VERSION = "v1.37.2"
TOOLS_DIRNAME = "kube-v1.37.2-helm-v4.3.1-kwok-v0.8.0"
ADMIN_TOKEN = "embedfleet-test-admin-token"
# The controller-manager's own identity, as in a real cluster (where admission rules may name it: the chart's
# node-cache volume policy names only the operator); in system:masters here because it runs with
# --use-service-account-credentials=false, so one identity does every controller's work.
CONTROLLERS_TOKEN = "embedfleet-test-controller-manager-token"
SERVICE_CIDR = "10.96.0.0/16"  # cluster IPs are only allocated, never sent traffic
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
#: Pods carrying this annotation keep the status a test writes (kwok leaves them alone).
MANUAL_STATUS_ANNOTATION = "embedfleet.dev/test-manual-status"


def tools_dir() -> Path | None:
    """The folder scripts/kube-tools.sh filled, or None when it has not run (or is incomplete)."""
    override = os.environ.get("EMBEDFLEET_KUBE_TOOLS")
    if override:
        path = Path(override)
    else:
        base = Path(os.environ.get("EMBEDFLEET_KUBE_CACHE") or Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedfleet")
        path = base / TOOLS_DIRNAME
    return path if (path / ".complete").exists() else None


def missing_reason() -> str | None:
    """Why control-plane tests cannot run here, or None when they can."""
    if tools_dir() is not None:
        return unavailable_reason()
    if shutil.which("go") is None:
        return "the test control plane needs Go (https://go.dev/doc/install), then `bash scripts/kube-tools.sh`"
    return "the test control plane is not built yet: run `bash scripts/kube-tools.sh` (about 12 min once)"


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except Exception as exc:  # a server still starting refuses connections
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


@dataclass
class Proc:
    """One process of the control plane, its log in a file."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


#: The control plane's processes run at a higher CPU priority than the tests' own (niceness 5 lower; as
#: root, else at the tests' priority). In a cluster the control plane has machines of its own; here it
#: shares two cores with the servers and builds the tests start, and an API server starved for seconds
#: makes controllers miss their leases' renew deadlines, a fault of the test machine, not of the product.
CONTROL_PLANE_NICE = -5


def spawn(name: str, argv: list[str], log_dir: Path, env: Mapping[str, str] | None = None) -> Proc:
    """A control-plane process (etcd, API server, controllers, kwok), at `CONTROL_PLANE_NICE`."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = spawn_child(argv, nice=CONTROL_PLANE_NICE, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    return Proc(name, popen, log_path)


def node_manifest(
    name: str,
    *,
    cpu: str = "16",
    memory: str = "64Gi",
    gpus: int = 0,
    gpu_product: str = "NVIDIA-H100-80GB-HBM3",
    region: str = "test-region-1",
    zone: str | None = None,
    labels: Mapping[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A fake Node kwok manages (Ready, with leases), optionally with ``nvidia.com/gpu`` capacity."""
    capacity = {"cpu": cpu, "memory": memory, "pods": "110"}
    all_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        "topology.kubernetes.io/region": region,
        "topology.kubernetes.io/zone": zone or f"{region}a",
        **(labels or {}),
    }
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
        all_labels["nvidia.com/gpu.product"] = gpu_product
        all_labels["nvidia.com/gpu.count"] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels, "annotations": {KWOK_ANNOTATION: "fake"}},
        "spec": {"taints": taints or []},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


DEFAULT_NODES = (
    {"name": "cpu-1"},
    {"name": "cpu-2"},
    {"name": "gpu-1", "gpus": 2},
    {"name": "gpu-2", "gpus": 2},
)

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    # A write to an EmbeddingDeployment's status keeps its body, so a test that finds an unexpected write
    # can say what it changed; everything else at Metadata (no bodies: Secrets stay out of the log).
    "rules": [{"level": "Request", "verbs": ["patch", "update"],
               "resources": [{"group": "embedfleet.dev", "resources": ["embeddingdeployments/status"]}]},
              {"level": "Metadata"}],
}


@dataclass
class AuditEvent:
    user: str
    verb: str
    code: int
    uri: str
    resource: str
    subresource: str
    namespace: str
    name: str
    dry_run: bool
    message: str = ""
    user_agent: str = ""
    #: When the API server received the request (Unix seconds; 0 when the event has no such stamp): a
    #: watch's event is written when it ends, so "called after X" must be judged by this, not log order.
    received: float = 0.0
    #: The credential the request was authenticated with (a ServiceAccount token's ``JTI=...``; "" if none):
    #: two tokens of one identity read as two credentials.
    credential: str = ""
    #: The request's body, abridged, where the audit policy keeps it (writes to an EmbeddingDeployment's status).
    body: str = ""
    #: When the API server answered it (the ResponseComplete stage's stamp; 0 when absent).
    completed: float = 0.0

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> AuditEvent:
        ref = raw.get("objectRef") or {}
        uri = raw.get("requestURI", "")
        def stamp(key: str) -> float:
            try:
                return datetime.fromisoformat(str(raw[key]).replace("Z", "+00:00")).timestamp()
            except (KeyError, ValueError):
                return 0.0

        received = stamp("requestReceivedTimestamp")
        return cls(
            user=(raw.get("user") or {}).get("username", ""),
            verb=raw.get("verb", ""),
            code=int((raw.get("responseStatus") or {}).get("code") or 0),
            uri=uri,
            resource=ref.get("resource", ""),
            subresource=ref.get("subresource", ""),
            namespace=ref.get("namespace", ""),
            name=ref.get("name", ""),
            dry_run="dryRun=" in uri,
            message=str((raw.get("responseStatus") or {}).get("message") or ""),
            user_agent=str(raw.get("userAgent") or ""),
            received=received,
            credential=",".join(((raw.get("user") or {}).get("extra") or {})
                                .get("authentication.kubernetes.io/credential-id") or []),
            body=json.dumps(raw["requestObject"], sort_keys=True)[:2000] if raw.get("requestObject") else "",
            completed=stamp("stageTimestamp"),
        )

    @property
    def is_write(self) -> bool:
        return self.verb in ("create", "update", "patch", "delete", "deletecollection") and not self.dry_run

    def __str__(self) -> str:
        where = "/".join(p for p in (self.namespace, self.resource, self.name) if p)
        sub = f"/{self.subresource}" if self.subresource else ""
        said = f": {self.message}" if self.message else ""
        body = f" with {self.body}" if self.body else ""
        return f"{self.code} {self.verb} {where}{sub} by {self.user}{said}{body}"


@dataclass
class Cluster:
    """One API server (and, when it has nodes, its controller-manager, scheduler and kwok)."""

    name: str
    workdir: Path
    port: int
    bin: Path = Path(".")
    procs: list[Proc] = field(default_factory=list)
    apiserver_argv: list[str] = field(default_factory=list)
    _audit_offset: int = 0

    # --------------------------------------------------------------- identity and clients

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_path(self) -> Path:
        return self.workdir / "certs" / "apiserver.crt"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def audit_path(self) -> Path:
        return self.workdir / "audit.log"

    def kubeconfig_for(self, token: str, path: Path, namespace: str = "default", user: str = "user") -> Path:
        """A kubeconfig that authenticates with a bearer token (a ServiceAccount's, or the admin's)."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": self.name, "cluster": {
                "server": self.url,
                "certificate-authority-data": base64.b64encode(self.ca_path.read_bytes()).decode(),
            }}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": self.name, "context": {"cluster": self.name, "user": user,
                                                         "namespace": namespace}}],
            "current-context": self.name,
        }
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        return path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        argv = [str(self.bin / "kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def apply(self, *docs: Mapping[str, Any], kubeconfig: Path | None = None) -> None:
        text = "\n---\n".join(json.dumps(d) for d in docs)
        self.kubectl("apply", "-f", "-", input=text, kubeconfig=kubeconfig)

    def install_crds(self) -> None:
        """The project's CRDs (crds/), applied and Established."""
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            self.kubectl("apply", "-f", str(path))
        self.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")

    def get_json(self, *args: str) -> Any:
        done = self.kubectl("get", *args, "-o", "json", check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr or "not found" in done.stderr:
                return None
            raise RuntimeError(f"kubectl get {' '.join(args)}: {done.stderr.strip()}")
        return json.loads(done.stdout)

    def helm(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        env = {**os.environ, "HELM_CACHE_HOME": str(self.workdir / "helm-cache"),
               "HELM_CONFIG_HOME": str(self.workdir / "helm-config"),
               "HELM_DATA_HOME": str(self.workdir / "helm-data")}
        argv = [str(self.bin / "helm"), f"--kubeconfig={self.kubeconfig}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        if check and done.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def token_for(self, namespace: str, service_account: str, duration: str = "2h") -> str:
        """A bound token of a ServiceAccount, exactly what a pod running as it would hold."""
        return self.kubectl("create", "token", service_account, "-n", namespace,
                            f"--duration={duration}").stdout.strip()

    def api_client(self, kubeconfig: Path | None = None):  # -> kubernetes.client.ApiClient
        from embedfleet.operator.kube import load_client

        return load_client(kubeconfig or self.kubeconfig)

    # --------------------------------------------------------------- audit

    def audit(self, since_mark: bool = True) -> list[AuditEvent]:
        """Audit events (ResponseComplete) since the last `audit_mark()`, or all of them."""
        if not self.audit_path.exists():
            return []
        with open(self.audit_path, "rb") as fh:
            if since_mark:
                fh.seek(self._audit_offset)
            data = fh.read()
        events = []
        for line in data.splitlines():
            try:
                raw = json.loads(line)
            except ValueError:
                continue  # a line still being written
            if raw.get("stage") == "ResponseComplete":
                events.append(AuditEvent.from_json(raw))
        return events

    def audit_mark(self) -> None:
        self._audit_offset = self.audit_path.stat().st_size if self.audit_path.exists() else 0

    # --------------------------------------------------------------- nodes and lifecycle

    def add_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        docs = [node_manifest(**dict(n)) for n in nodes]
        if docs:
            self.apply(*docs)

    def ready(self) -> bool:
        try:
            ctx = ssl.create_default_context(cafile=str(self.ca_path))
            req = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop_apiserver(self) -> None:
        """Stop only this cluster's API server (a partition, or a restart test)."""
        for proc in self.procs:
            if proc.name == f"{self.name}-apiserver":
                proc.stop()

    def start_apiserver(self) -> None:
        """(Re)start the API server with the same flags and port; waits for /readyz."""
        for i, proc in enumerate(self.procs):
            if proc.name == f"{self.name}-apiserver":
                if proc.alive():
                    return
                self.procs[i] = spawn(proc.name, self.apiserver_argv, self.workdir)
                break
        wait_until(self.ready, 60, f"{self.name} apiserver /readyz")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (alive={p.alive()})\n{p.log_tail()}" for p in self.procs)


class ControlPlane:
    """One etcd and any number of clusters on it."""

    def __init__(self, workdir: Path, bin_dir: Path) -> None:
        self.workdir = workdir
        self.bin = bin_dir
        self.etcd: Proc | None = None
        self.etcd_port = 0
        self.clusters: dict[str, Cluster] = {}
        self.sa_key = workdir / "sa.key"
        self.sa_pub = workdir / "sa.pub"
        self.tools = bin_dir.parent

    @classmethod
    def start(cls, workdir: Path) -> ControlPlane:
        tools = tools_dir()
        if tools is None:
            raise RuntimeError(missing_reason())
        workdir.mkdir(parents=True, exist_ok=True)
        guard_pod_range()  # before any pod exists: no pod IP may lead off this machine
        plane = cls(workdir, tools / "bin")
        try:
            plane._start_etcd()
            plane._keys()
        except Exception:
            plane.stop()
            raise
        return plane

    def _start_etcd(self) -> None:
        self.etcd_port, peer = free_port(), free_port()
        data = self.workdir / "etcd"
        self.etcd = spawn("etcd", [
            str(self.bin / "etcd"), "--name=test", f"--data-dir={data}",
            f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=test=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn",
            "--quota-backend-bytes=4294967296",
        ], self.workdir)

        def healthy() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health", timeout=2) as resp:
                return b'"true"' in resp.read()

        wait_until(healthy, 30, "etcd /health")

    def _keys(self) -> None:
        subprocess.run(["openssl", "genrsa", "-out", str(self.sa_key), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub)],
                       check=True, capture_output=True)

    def add_cluster(
        self,
        name: str,
        nodes: Iterable[Mapping[str, Any]] | None = DEFAULT_NODES,
        *,
        controllers: bool = True,
        kwok_config: str | None = None,
    ) -> Cluster:
        """An API server on this etcd under its own prefix; with ``controllers`` also the
        controller-manager, scheduler and kwok, and ``nodes`` registered as kwok fake nodes."""
        workdir = self.workdir / name
        (workdir / "certs").mkdir(parents=True, exist_ok=True)
        port = free_port()
        cluster = Cluster(name=name, workdir=workdir, port=port, bin=self.bin)
        self.clusters[name] = cluster
        (workdir / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin,"system:masters"\n'
                                            f'{CONTROLLERS_TOKEN},system:kube-controller-manager,kcm,"system:masters"\n')
        (workdir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        cluster.apiserver_argv = [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--etcd-prefix=/registry-{name}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            "--endpoint-reconciler-type=none",
            "--authorization-mode=Node,RBAC",
            f"--token-auth-file={workdir / 'tokens.csv'}",
            f"--service-account-key-file={self.sa_pub}",
            f"--service-account-signing-key-file={self.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--cert-dir={workdir / 'certs'}",
            f"--audit-log-path={cluster.audit_path}",
            f"--audit-policy-file={workdir / 'audit-policy.yaml'}",
            "--audit-log-format=json", "--audit-log-maxsize=0",
            "--allow-privileged=true",
            "--profiling=false",
        ]
        try:
            cluster.procs.append(spawn(f"{name}-apiserver", cluster.apiserver_argv, workdir))
            wait_until(lambda: cluster.ca_path.exists(), 30, f"{name} serving certificate")
            wait_until(cluster.ready, 60, f"{name} apiserver /readyz")
            cluster.kubeconfig_for(ADMIN_TOKEN, cluster.kubeconfig, user="admin")
            if controllers:
                self._start_controllers(cluster, kwok_config)
                if nodes:
                    cluster.add_nodes(nodes)
            # The `default` ServiceAccount appears once the controller-manager runs; tests create pods.
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{cluster.logs()}") from exc
        cluster.audit_mark()
        return cluster

    def _start_controllers(self, cluster: Cluster, kwok_config: str | None) -> None:
        kc = str(cluster.kubeconfig)
        kcm = str(cluster.kubeconfig_for(CONTROLLERS_TOKEN, cluster.workdir / "controller-manager.kubeconfig",
                                         user="system:kube-controller-manager"))
        cluster.procs.append(spawn(f"{cluster.name}-controller-manager", [
            str(self.bin / "kube-controller-manager"), f"--kubeconfig={kcm}",
            "--controllers=*", "--leader-elect=false",
            f"--service-account-private-key-file={self.sa_key}",
            f"--root-ca-file={cluster.ca_path}",
            "--use-service-account-credentials=false",
            "--bind-address=127.0.0.1", "--secure-port=0",
            # kwok pods have no kubelet: do not wait minutes before noticing a Node went away.
            "--node-monitor-grace-period=60s",
            "--concurrent-deployment-syncs=10", "--concurrent-replicaset-syncs=10",
            "--concurrent-gc-syncs=20",
        ], cluster.workdir))
        cluster.procs.append(spawn(f"{cluster.name}-scheduler", [
            str(self.bin / "kube-scheduler"), f"--kubeconfig={kc}", "--leader-elect=false",
            "--bind-address=127.0.0.1", "--secure-port=0",
        ], cluster.workdir))
        config_path = cluster.workdir / "kwok.yaml"
        config_path.write_text(kwok_config or kwok_stages(self.tools))
        cluster.procs.append(spawn(f"{cluster.name}-kwok", [
            str(self.bin / "kwok"), f"--kubeconfig={kc}", f"-c={config_path}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            "--node-lease-duration-seconds=40",
            f"--cidr={POD_CIDR}", "--node-ip=198.19.0.1",
            f"--server-address=127.0.0.1:{free_port()}",
        ], cluster.workdir))
        wait_until(lambda: cluster.get_json("serviceaccount", "default", "-n", "default"), 60,
                   f"{cluster.name} controller-manager (default ServiceAccount)")

    def stop(self) -> None:
        for cluster in reversed(list(self.clusters.values())):
            cluster.stop()
        if self.etcd is not None:
            self.etcd.stop()


def kwok_stages(tools: Path) -> str:
    """kwok's configuration: the stages scripts/kube-tools.sh copied, and options that let a test own
    a pod's status (pods annotated with MANUAL_STATUS_ANNOTATION)."""
    docs: list[str] = [yaml.safe_dump({
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokConfiguration",
        "options": {
            "disregardStatusWithAnnotationSelector": f"{MANUAL_STATUS_ANNOTATION}=true",
            "podPlayStageParallelism": 4,
            "nodePlayStageParallelism": 4,
            "nodeLeaseParallelism": 4,
            "podsOnNodeSyncParallelism": 1,
        },
    })]
    for path in sorted((tools / "kwok").glob("*.yaml")):
        docs.append(path.read_text())
    return "\n---\n".join(d.strip().removeprefix("---").strip() for d in docs) + "\n"
