"""Peers found through the real API server, as the chart's node-agent identity with nodeAgent.peers on.

The chart is installed (kwok runs its DaemonSet's pods: one agent pod per node, with pod IPs); two real
agent processes stand for the agents of gpu-1 and gpu-2, each with its own cache root. gpu-1's agent pulls
from the origin and labels its node, then runs as the daemon with its peer server on its pod's IP (made an
address of this machine); gpu-2's agent finds gpu-1 by the label and the agent pods' IPs (nodes list, pods
list: the chart's Role) and fetches from it. The origin sees no request from gpu-2; the audit log shows
the two lists and no refusal. The same two agents then carry engine builds: what gpu-1's runtimes built
(an int8 build for this machine's CPU class, a plan for the nodes' GPU model) reaches gpu-2 through the
engine labels before any runtime starts there."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from file_server import serve_files
from peer_helpers import make_build, model
from tests.kube.controlplane import ROOT as REPO
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.netns import PodNetwork, pod_ip_on_host
from tests.kube.operator_proc import BENIGN, render_chart
from tests.operator.real import release
from tests.procs import free_port

from embedfleet.operator.cache.digest import manifest_lines, render_manifest, verify_entry
from embedfleet.operator.cache.engines import SOURCE_RECORD, cpu_accelerator, gpu_accelerator, list_builds
from embedfleet.operator.crd import naming

NODES = ("gpu-1", "gpu-2")


def _agent_pods(cluster: Cluster, namespace: str) -> dict[str, str]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/name=embedfleet-node-agent")["items"]
    return {p["spec"].get("nodeName"): p["status"].get("podIP") for p in pods
            if p["spec"].get("nodeName") in NODES and p["status"].get("podIP")}


@dataclass
class Agents:
    """The two agents' command lines, environment and cache roots, as the chart's DaemonSet runs them."""

    cluster: Cluster
    team: str
    digest: str
    origin: Any
    port: int
    ips: dict[str, str]
    roots: dict[str, Path]
    user: str
    command: Callable[..., list[str]]
    env_base: dict[str, str]

    def once(self, node: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, "--once"), env={**self.env_base, "NODE_NAME": node},
                              capture_output=True, text=True, timeout=120)

    @contextlib.contextmanager
    def serving(self, node: str, tmp_path: Path) -> Iterator[list[str]]:
        """``node``'s agent as the daemon, its peer server on its pod's IP; yields a list its output lands in."""
        out: list[str] = []
        with pod_ip_on_host(self.ips[node]):
            health = tmp_path / f"health-{node}"
            proc = subprocess.Popen(self.command(node, "--interval=300", f"--health-dir={health}"),
                                    env={**self.env_base, "NODE_NAME": node}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            try:
                wait_until(lambda: proc.poll() is None and (health / "ready").exists(), 60,
                           f"{node}'s agent serving its peers")
                yield out
            finally:
                proc.terminate()
                out.append(proc.communicate(timeout=30)[0])

    def labels(self, node: str) -> dict[str, str]:
        return self.cluster.get_json("node", node)["metadata"]["labels"]

    def check_audit(self) -> None:
        time.sleep(1)  # the audit log is written asynchronously
        events = [e for e in self.cluster.audit() if e.user == self.user]
        assert {(e.verb, e.resource) for e in events} >= {("list", "nodes"), ("list", "pods")}
        refused = [str(e) for e in events if e.code >= 400 and (e.code, e.verb) not in BENIGN]
        assert refused == [], refused


@contextlib.contextmanager
def two_agents(cluster: Cluster, unique: str, tmp_path: Path, tag: str) -> Iterator[Agents]:
    """A chart release with peers on, a tenant namespace, an origin serving a small model, and the two agents."""
    port = free_port()
    sets = {"nodeAgent.peers.enabled": "true", "nodeAgent.peers.port": str(port)}
    with serve_files() as origin, \
            release(cluster, tmp_path, f"{tag}{unique}", sets=sets, start=False) as (system_ns, _):
        digest = model(tmp_path / "model", weights_bytes=512 * 1024)
        (tmp_path / "model" / "SHA256SUMS").write_bytes(render_manifest(manifest_lines(tmp_path / "model")))
        origin.publish_dir("/m/", tmp_path / "model")
        team = f"team-{tag}-{unique}"
        cluster.kubectl("create", "namespace", team)
        ips = wait_until(lambda: (found := _agent_pods(cluster, system_ns)) and len(found) == 2 and found,
                         90, "the DaemonSet's agent pods on gpu-1 and gpu-2, with pod IPs")

        docs = render_chart(cluster, f"ef-{tag}{unique}", system_ns, sets=sets)
        (ds,) = [d for d in docs if d.get("kind") == "DaemonSet"]
        pod: dict[str, Any] = ds["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        kubeconfig = cluster.kubeconfig_for(cluster.token_for(system_ns, pod["serviceAccountName"]),
                                            tmp_path / "agent.kubeconfig", namespace=system_ns)
        env_base = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
                    "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": system_ns,
                    "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("runtime", "operator", "client"))}
        roots = {node: tmp_path / f"root-{node}" for node in NODES}

        key = tmp_path / "peer.key"  # the release's Secret, as the chart mounts it into each agent
        key.write_text(os.urandom(32).hex())

        def command(node: str, *extra: str) -> list[str]:
            args = [a.replace("$(POD_IP)", ips[node]).replace("/etc/embedfleet/peer/key", str(key))
                    for a in container["args"] if not a.startswith(("--cache-root=", "--health-dir="))]
            return [sys.executable, "-m", "embedfleet.runtime.cli", "cache", "agent",
                    f"--cache-root={roots[node]}", *args, *extra]

        cluster.audit_mark()
        yield Agents(cluster, team, digest, origin, port, ips, roots,
                     f"system:serviceaccount:{system_ns}:{pod['serviceAccountName']}", command, env_base)


GPU_POOL = [{"name": "gpu", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}]


def test_an_agent_fetches_from_the_node_its_lookup_finds(kube_cluster: Cluster, unique: str, tmp_path: Path,
                                                          pod_network: PodNetwork) -> None:
    cluster = kube_cluster
    with two_agents(cluster, unique, tmp_path, "p") as agents:
        team, digest, origin = agents.team, agents.digest, agents.origin
        cluster.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "ModelCache",
                       "metadata": {"name": "weights", "namespace": team},
                       "spec": {"model": {"source": origin.url + "/m/", "digest": digest}, "nodePools": GPU_POOL}})
        first = agents.once("gpu-1")
        assert first.returncode == 0, first.stderr[-3000:]
        entry = naming.cache_entry(team, digest)
        assert json.loads((agents.roots["gpu-1"] / entry / ".source.json").read_text())["source"] == "origin"
        key = naming.cache_label_key(digest, team)
        assert agents.labels("gpu-1").get(key) == "ready"
        asked = len(origin.requests)

        with agents.serving("gpu-1", tmp_path) as out:
            second = agents.once("gpu-2")
        assert second.returncode == 0, second.stderr[-3000:]
        assert "source=peer" in second.stderr, second.stderr[-3000:]
        record = json.loads((agents.roots["gpu-2"] / entry / ".source.json").read_text())
        assert record["source"] == "peer" and record["from"] == f"http://{agents.ips['gpu-1']}:{agents.port}"
        assert verify_entry(agents.roots["gpu-2"] / entry, digest) == "digest"
        assert len(origin.requests) == asked, origin.requests[asked:]
        assert f"serving {entry}/model.safetensors" in out[0]
        assert agents.labels("gpu-2").get(key) == "ready"
        agents.check_audit()
        cluster.kubectl("delete", "modelcache", "weights", "-n", team, "--wait=true", "--timeout=60s")


def test_engine_builds_reach_another_node_before_its_runtime_starts(kube_cluster: Cluster, unique: str,
                                                                   tmp_path: Path, pod_network: PodNetwork) -> None:
    """An int8 deployment with pre-pull: gpu-1's agent makes the tenant's engines folder, its runtimes build
    (a build per accelerator is written here as a runtime writes one), the agent labels gpu-1 per
    accelerator; gpu-2's agent finds gpu-1 by those labels and copies both builds, byte for byte."""
    cluster = kube_cluster
    with two_agents(cluster, unique, tmp_path, "e") as agents:
        team, digest = agents.team, agents.digest
        cluster.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "EmbeddingDeployment",
                       "metadata": {"name": "quant", "namespace": team},
                       "spec": {"model": {"source": agents.origin.url + "/m/", "digest": digest},
                                "runtime": {"dtype": "int8"},
                                "cache": {"prePull": True, "nodePools": GPU_POOL}}})
        try:
            first = agents.once("gpu-1")
            assert first.returncode == 0, first.stderr[-3000:]
            folder = agents.roots["gpu-1"] / naming.engines_entry(team, digest)
            assert folder.is_dir() and list_builds(folder) == []  # made for the runtimes; nothing built yet
            cpu, gpu = cpu_accelerator(), gpu_accelerator("NVIDIA H100 80GB HBM3")
            hexd = naming.digest_hex(digest)[:16]
            built = [make_build(folder, f"{cpu}/sha256-{hexd}/int8-cpu-0123456789abcdef",
                                {"model.xml": b"<net/>", "model.bin": os.urandom(400_000), "int8.json": b"{}"}),
                     make_build(folder, f"{gpu}/quant-{hexd}/trtllm-0123456789abcdef",
                                {"rank0.engine": os.urandom(300_000)})]
            assert agents.once("gpu-1").returncode == 0
            engine_keys = {naming.engine_label_key(digest, team, a) for a in (cpu, gpu)}
            assert {k: v for k, v in agents.labels("gpu-1").items() if k in engine_keys} == dict.fromkeys(
                engine_keys, "ready")

            with agents.serving("gpu-1", tmp_path) as out:
                second = agents.once("gpu-2")
            assert second.returncode == 0, second.stderr[-3000:]
            mine = agents.roots["gpu-2"] / naming.engines_entry(team, digest)
            assert sorted(b.rel for b in list_builds(mine)) == sorted(b.relative_to(folder).as_posix() for b in built)
            for build in built:
                rel = build.relative_to(folder)
                assert {f.name: f.read_bytes() for f in build.iterdir()} == {
                    f.name: f.read_bytes() for f in (mine / rel).iterdir() if f.name != SOURCE_RECORD}
                assert json.loads((mine / rel / SOURCE_RECORD).read_text())["from"] == (
                    f"http://{agents.ips['gpu-1']}:{agents.port}")
            assert "fetched from peer" in second.stderr and "serving engine" in out[0]
            assert {k for k, v in agents.labels("gpu-2").items() if v == "ready"} >= engine_keys
            agents.check_audit()
        finally:
            cluster.kubectl("delete", "embeddingdeployment", "quant", "-n", team, "--wait=false")
