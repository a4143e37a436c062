"""Cold starts on the real node (scripts/realnode.sh) with weights and int8 engine builds from a peer node.

Root only; builds nothing (run `bash scripts/setup.sh --test` as root first). One real node (kubelet,
containerd, the project's images) and the chart with `nodeAgent.peers.enabled`. The peer node is a second
Node object with no kubelet: its agent is `embedfleet cache serve-peers` on this machine, at the node
bridge's address, over a cache root holding what the real node made earlier; its agent pod is a Pod object
with the DaemonSet's labels whose status says Ready at that address (a heartbeat keeps the Node Ready, a
taint keeps every workload off it). The real node's agent finds it exactly as it finds a real peer: the
node labels and the agent pods' IPs. Rows, each from `kubectl apply` to the first answer, split by the
pod's own timestamps (bench/realnode_coldstart.py):

  download   float32, http:// model with pre-pull, node cache empty: the init container downloads
  cached     the same re-created once the agent holds the weights: the init container links
  peer       node cache emptied, the peer holds the weights; `requireCachedNode`: the pod waits for the agent,
             which fetches from the peer (never the origin), then links
  int8-build `dtype: int8` with pre-pull, weights on the node, engines folder empty: the runtime builds into
             the folder the agent made (hostPath, writable by the runtime container only)
  int8-peer  node cache and engines folder emptied, the peer holds both: the agent fetches the weights and
             the build; the runtime loads the build (`/load` says engine source `peer`)

Ratios against the baselines of the same run: peer / download, int8-peer / int8-build. One JSON line, also
appended to bench/results/realnode-peer-cpu.jsonl.

    sudo .venv/bin/python bench/realnode_peer.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), *(str(ROOT / p) for p in ("runtime", "operator", "client"))]

import httpx  # noqa: E402
from tests.kube.controlplane import wait_until  # noqa: E402
from tests.realnode.node import (  # noqa: E402
    BRIDGE_IP,
    NAMESPACE,
    RUNTIME_PORT,
    ModelServer,
    RealNode,
    realnode_home,
)
from tests.realnode.test_user_path import all_runtimes, http_deployment  # noqa: E402

from _common import add_results_dir, record  # noqa: E402
from embedfleet.operator.cache.engines import list_builds  # noqa: E402
from embedfleet.operator.crd import naming  # noqa: E402
from realnode_coldstart import cold_start, installed_node  # noqa: E402

PEER_NODE = "realnode-peer"
PEER_PORT = 8476
NODE = "realnode-1"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextlib.contextmanager
def peer_node(node: RealNode, root: Path, labels: dict[str, str]) -> Iterator[None]:
    """The peer: serve-peers over ``root`` at BRIDGE_IP, a Node carrying ``labels`` and an agent Pod on it."""
    (ds,) = [d for d in node.get("daemonset", "-n", NAMESPACE)["items"]
             if d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name") == "embedfleet-node-agent"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    server = subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", "cache", "serve-peers",
                               "--cache-root", str(root), "--host", BRIDGE_IP, "--port", str(PEER_PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop = threading.Event()
    node.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": PEER_NODE, "labels": labels},
        "spec": {"taints": [{"key": "embedfleet.dev/bench-peer", "value": "true", "effect": "NoSchedule"}]}}))

    def heartbeat() -> None:
        while not stop.is_set():
            status = {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "BenchPeer",
                                                 "lastHeartbeatTime": now(), "lastTransitionTime": now()}]}}
            node.kubectl("patch", "node", PEER_NODE, "--subresource=status", "--type=merge", "-p",
                         json.dumps(status), check=False)
            stop.wait(5)

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    node.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "bench-peer-agent", "namespace": NAMESPACE, "labels": pod_labels},
        "spec": {"nodeName": PEER_NODE, "containers": [{"name": "agent", "image": "none"}],
                 "tolerations": [{"operator": "Exists"}]}}))
    node.kubectl("patch", "pod", "bench-peer-agent", "-n", NAMESPACE, "--subresource=status", "--type=merge", "-p",
                 json.dumps({"status": {"phase": "Running", "podIP": BRIDGE_IP, "podIPs": [{"ip": BRIDGE_IP}],
                                        "conditions": [{"type": "Ready", "status": "True"}]}}))
    try:
        wait_until(lambda: httpx.get(f"http://{BRIDGE_IP}:{PEER_PORT}/healthz", timeout=1).status_code == 200,
                   30, "the peer's server")
        yield
    finally:
        stop.set()
        beat.join(10)
        server.terminate()
        server.wait(30)
        node.kubectl("delete", "pod", "bench-peer-agent", "-n", NAMESPACE, "--grace-period=0", "--force",
                     "--ignore-not-found", check=False)
        node.kubectl("delete", "node", PEER_NODE, "--ignore-not-found", check=False)


def forget(node: RealNode, cache: Path, *names: str) -> None:
    """Empty the real node's cache of ``names`` (as if the node were new) and drop its cache labels."""
    for name in names:
        shutil.rmtree(cache / name, ignore_errors=True)
        (cache / f".lock-{name}").unlink(missing_ok=True)
    labels = node.get("node", NODE)["metadata"]["labels"]
    drop = [f"{k}-" for k in labels if k.startswith(naming.CACHE_LABEL_PREFIX)]
    if drop:
        node.kubectl("label", "node", NODE, *drop)


def delete(node: RealNode, name: str) -> None:
    node.kubectl("delete", "embeddingdeployment", name, "--ignore-not-found", "--wait=true", timeout=300)
    wait_until(lambda: not all_runtimes(node, name), 300, f"{name}'s pods gone")


def engine_source(node: RealNode, name: str) -> dict[str, Any] | None:
    pod = next(p for p in all_runtimes(node, name) if p["status"].get("podIP"))
    report = httpx.get(f"http://{pod['status']['podIP']}:{RUNTIME_PORT}/load", timeout=10).json().get("startup") or {}
    return next((m.get("engine") for m in (report.get("models") or {}).values() if m.get("engine")), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_dir(parser, "realnode-peer-cpu.jsonl")
    args = parser.parse_args()
    home = realnode_home()
    cache = home / "nodecache"
    with installed_node("realnode-peer-", cache, "--set", "nodeAgent.peers.enabled=true", "--set",
                        f"nodeAgent.peers.port={PEER_PORT}", "--set", "nodeAgent.intervalSeconds=5") as (node, work):
        served = None
        try:
            served = ModelServer(work)
            http = http_deployment("minilm-http", served.url, served.digest)
            entry = naming.cache_entry("default", served.digest)
            label = naming.cache_label_key(served.digest, "default")
            rows: dict[str, Any] = {"download": cold_start(node, http)}
            wait_until(lambda: node.get("node", NODE)["metadata"]["labels"].get(label) == "ready", 300, "cache label")
            rows["cached"] = cold_start(node, http)
            delete(node, "minilm-http")

            peer_root = work / "peer-root"
            peer_root.mkdir()
            shutil.copytree(cache / entry, peer_root / entry, symlinks=True)
            forget(node, cache, entry)
            required = json.loads(json.dumps(http))
            required["spec"]["cache"]["requireCachedNode"] = True
            with peer_node(node, peer_root, {label: "ready"}):
                rows["peer"] = cold_start(node, required)
            rows["peer"]["weights_record"] = json.loads((cache / entry / ".source.json").read_text())
            delete(node, "minilm-http")
            # unwanted now: the agent drops the label, so the next deployment's pod waits for the agent's pass
            # that makes its engines folder (the folder comes before the label in a pass)
            wait_until(lambda: label not in node.get("node", NODE)["metadata"]["labels"], 60, "label dropped")

            quant = json.loads(json.dumps(required))
            quant["metadata"]["name"] = "minilm-int8"
            quant["spec"]["runtime"] = {**quant["spec"].get("runtime", {}), "dtype": "int8"}
            engines = naming.engines_entry("default", served.digest)
            rows["int8-build"] = cold_start(node, quant)
            rows["int8-build"]["engine"] = engine_source(node, "minilm-int8")
            builds = list_builds(cache / engines)
            delete(node, "minilm-int8")
            shutil.copytree(cache / engines, peer_root / engines, symlinks=True)
            forget(node, cache, entry, engines)
            engine_labels = {naming.engine_label_key(served.digest, "default", b.accelerator): "ready" for b in builds}
            with peer_node(node, peer_root, {label: "ready", **engine_labels}):
                rows["int8-peer"] = cold_start(node, quant)
                rows["int8-peer"]["engine"] = engine_source(node, "minilm-int8")
            delete(node, "minilm-int8")
            result = {
                "bench": "realnode_peer",
                "rows": rows,
                "builds": [b.rel for b in builds],
                "peer_over_download": round(rows["peer"]["total_s"] / rows["download"]["total_s"], 3),
                "int8_peer_over_build": round(rows["int8-peer"]["total_s"] / rows["int8-build"]["total_s"], 3),
            }
            print(json.dumps(result))
            record("realnode-peer", result, results_dir=args.results_dir)
        finally:
            if served is not None:
                served.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
