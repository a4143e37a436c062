"""Peers found through the real API server, as the chart's node-agent identity with nodeAgent.peers on.

The chart is installed (kwok runs its DaemonSet's pods: one agent pod per node, with pod IPs); two real
agent processes stand for the agents of gpu-1 and gpu-2, each with its own cache root. gpu-1's agent pulls
from the origin and labels its node, then runs as the daemon with its peer server on its pod's IP (made an
address of this machine); gpu-2's agent finds gpu-1 by the label and the agent pods' IPs (nodes list, pods
list: the chart's Role) and fetches from it. The origin sees no request from gpu-2; the audit log shows
the two lists and no refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from file_server import serve_files
from peer_helpers import model
from tests.kube.controlplane import ROOT as REPO
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.netns import PodNetwork, pod_ip_on_host
from tests.kube.operator_proc import BENIGN, render_chart
from tests.operator.real import release
from tests.procs import free_port

from embedfleet.operator.cache.digest import manifest_lines, render_manifest, verify_entry
from embedfleet.operator.crd import naming

NODES = ("gpu-1", "gpu-2")


def _agent_pods(cluster: Cluster, namespace: str) -> dict[str, str]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/name=embedfleet-node-agent")["items"]
    return {p["spec"].get("nodeName"): p["status"].get("podIP") for p in pods
            if p["spec"].get("nodeName") in NODES and p["status"].get("podIP")}


def test_an_agent_fetches_from_the_node_its_lookup_finds(kube_cluster: Cluster, unique: str, tmp_path: Path,
                                                          pod_network: PodNetwork) -> None:
    cluster = kube_cluster
    port = free_port()
    sets = {"nodeAgent.peers.enabled": "true", "nodeAgent.peers.port": str(port)}
    with serve_files() as origin, release(cluster, tmp_path, f"p{unique}", sets=sets, start=False) as (system_ns, _):
        digest = model(tmp_path / "model", weights_bytes=512 * 1024)
        (tmp_path / "model" / "SHA256SUMS").write_bytes(render_manifest(manifest_lines(tmp_path / "model")))
        origin.publish_dir("/m/", tmp_path / "model")
        team = f"team-p-{unique}"
        cluster.kubectl("create", "namespace", team)
        ips = wait_until(lambda: (found := _agent_pods(cluster, system_ns)) and len(found) == 2 and found,
                         90, "the DaemonSet's agent pods on gpu-1 and gpu-2, with pod IPs")

        docs = render_chart(cluster, f"ef-p{unique}", system_ns, sets=sets)
        (ds,) = [d for d in docs if d.get("kind") == "DaemonSet"]
        pod: dict[str, Any] = ds["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        user = f"system:serviceaccount:{system_ns}:{pod['serviceAccountName']}"
        kubeconfig = cluster.kubeconfig_for(cluster.token_for(system_ns, pod["serviceAccountName"]),
                                            tmp_path / "agent.kubeconfig", namespace=system_ns)
        env_base = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
                    "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": system_ns,
                    "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("runtime", "operator", "client"))}
        roots = {node: tmp_path / f"root-{node}" for node in NODES}

        def agent(node: str, *extra: str) -> list[str]:
            args = [a.replace("$(POD_IP)", ips[node]) for a in container["args"]
                    if not a.startswith(("--cache-root=", "--health-dir="))]
            return [sys.executable, "-m", "embedfleet.runtime.cli", "cache", "agent",
                    f"--cache-root={roots[node]}", *args, *extra]

        gpu_pool = [{"name": "gpu", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}]
        cluster.audit_mark()
        cluster.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "ModelCache",
                       "metadata": {"name": "weights", "namespace": team},
                       "spec": {"model": {"source": origin.url + "/m/", "digest": digest}, "nodePools": gpu_pool}})
        first = subprocess.run(agent("gpu-1", "--once"), env={**env_base, "NODE_NAME": "gpu-1"},
                               capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr[-3000:]
        entry = naming.cache_entry(team, digest)
        assert json.loads((roots["gpu-1"] / entry / ".source.json").read_text())["source"] == "origin"
        key = naming.cache_label_key(digest, team)
        assert cluster.get_json("node", "gpu-1")["metadata"]["labels"].get(key) == "ready"
        asked = len(origin.requests)

        with pod_ip_on_host(ips["gpu-1"]):
            health = tmp_path / "health-gpu-1"
            serving = subprocess.Popen(agent("gpu-1", "--interval=300", f"--health-dir={health}"),
                                       env={**env_base, "NODE_NAME": "gpu-1"}, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            try:
                wait_until(lambda: serving.poll() is None and (health / "ready").exists(), 60,
                           "gpu-1's agent serving its peers")
                second = subprocess.run(agent("gpu-2", "--once"), env={**env_base, "NODE_NAME": "gpu-2"},
                                        capture_output=True, text=True, timeout=120)
            finally:
                serving.terminate()
                out, _ = serving.communicate(timeout=30)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "source=peer" in second.stderr, second.stderr[-3000:]
        record = json.loads((roots["gpu-2"] / entry / ".source.json").read_text())
        assert record["source"] == "peer" and record["from"] == f"http://{ips['gpu-1']}:{port}"
        assert verify_entry(roots["gpu-2"] / entry, digest) == "digest"
        assert len(origin.requests) == asked, origin.requests[asked:]
        assert f"serving {entry}/model.safetensors" in out
        assert cluster.get_json("node", "gpu-2")["metadata"]["labels"].get(key) == "ready"

        time.sleep(1)  # the audit log is written asynchronously
        events = [e for e in cluster.audit() if e.user == user]
        assert {(e.verb, e.resource) for e in events} >= {("list", "nodes"), ("list", "pods")}
        refused = [str(e) for e in events if e.code >= 400 and (e.code, e.verb) not in BENIGN]
        assert refused == [], refused
        cluster.kubectl("delete", "modelcache", "weights", "-n", team, "--wait=true", "--timeout=60s")
