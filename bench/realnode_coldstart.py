"""Cold starts on the real node (scripts/realnode.sh): from `kubectl apply` to the first answer, phase by phase.

Root only; builds nothing (run `bash scripts/setup.sh --test` as root first). One node, one chart release, then:
  present   the example (model baked into the image, file://), runtime image already in containerd
  imported  the same after removing the runtime image from containerd and importing it again (no registry here:
            the import stands for a pull; its own seconds are reported apart)
  download  an http:// model with pre-pull, node cache empty: the init container downloads and verifies
  cached    the same deployment re-created once the node agent cached the weights: the init container links
  wake      scaled to zero, one request through the gateway's hold until it is answered
Each row splits the time with the pod's own timestamps (whole seconds): scheduling (created -> PodScheduled),
sandbox and image (-> first container started), weights (the init container's run), engine load and first
answer (runtime started -> the first 200 this client saw), and how much later the kubelet marked the pod Ready.
Also the images' sizes and each workload's memory (containerd's working set). Ratios are against the baselines
measured in the same run: cached / download, present / imported. One JSON line, also appended to
bench/results/realnode-coldstart-cpu.jsonl.

    sudo .venv/bin/python bench/realnode_coldstart.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), *(str(ROOT / p) for p in ("runtime", "operator", "client", "gateway"))]

import yaml  # noqa: E402
from tests.kube.controlplane import wait_until  # noqa: E402
from tests.realnode.node import (  # noqa: E402
    GATEWAY_PORT,
    NAMESPACE,
    RUNTIME_PORT,
    SCRIPT,
    RealNode,
    embed,
    is_ready,
    realnode_home,
    runtime_selector,
)
from tests.realnode.test_user_path import (  # noqa: E402
    CHART,
    CHART_VALUES,
    ModelServer,
    all_runtimes,
    example,
    gateway_ip,
    http_deployment,
)

from _common import add_results_dir, record  # noqa: E402


@contextlib.contextmanager
def installed_node(prefix: str, cache: Path, *sets: str) -> Iterator[tuple[RealNode, Path]]:
    """A real node up (scripts/realnode.sh) in a temporary folder, with the chart installed as the real-node
    tests install it, the node cache at `cache` and `sets` (`--set` pairs); the node and the folder go
    afterwards. Yields the node and the folder."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        up = subprocess.run(["bash", str(SCRIPT), "up", str(work / "node")], capture_output=True, text=True)
        if up.returncode != 0:
            raise RuntimeError(f"scripts/realnode.sh up failed: {up.stderr[-2000:]}")
        node = RealNode(workdir=work / "node", home=realnode_home())
        try:
            node.helm("upgrade", "--install", "embedfleet", str(CHART), "-n", NAMESPACE, "--create-namespace",
                      *CHART_VALUES, "--set", f"platform.cacheRoot={cache}", *sets, "--wait", "--timeout", "10m",
                      timeout=700)
            yield node, work
        finally:
            subprocess.run(["bash", str(SCRIPT), "down", str(work / "node")], capture_output=True, text=True)


def stamp(text: str | None) -> float | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else None


def first_answer(node: RealNode, name: str, model: str, t0: float, timeout: float = 900) -> float:
    def answered() -> float | None:
        for pod in all_runtimes(node, name):
            ip = pod.get("status", {}).get("podIP")
            if ip and not pod["metadata"].get("deletionTimestamp"):
                try:
                    if embed(ip, RUNTIME_PORT, ["cold start"], timeout=5, model=model).status_code == 200:
                        return time.time()
                except Exception:  # not listening yet
                    pass
        return None

    return wait_until(answered, timeout, f"a first 200 from {name}", interval=0.1) - t0


def phases(node: RealNode, name: str, t0: float, answered_at: float) -> dict[str, Any]:
    pod = next(p for p in all_runtimes(node, name) if is_ready(p))
    conditions = {c["type"]: stamp(c.get("lastTransitionTime")) for c in pod["status"]["conditions"]}
    created = stamp(pod["metadata"]["creationTimestamp"])
    init = (pod["status"].get("initContainerStatuses") or [{}])[0].get("state", {}).get("terminated", {})
    runtime = next(c for c in pod["status"]["containerStatuses"] if c["name"] == "runtime")
    started = stamp(runtime.get("state", {}).get("running", {}).get("startedAt"))
    init_start, init_end = stamp(init.get("startedAt")), stamp(init.get("finishedAt"))
    first_started = init_start or started
    out = {
        "total_s": round(answered_at - t0, 2),
        "scheduling_s": round(conditions["PodScheduled"] - created, 1),
        "sandbox_and_image_s": round(first_started - conditions["PodScheduled"], 1),
        "weights_s": round(init_end - init_start, 1) if init_start and init_end else 0.0,
        # the runtime's process start to the first 200 this client saw: model load, warm-up, first request
        "engine_load_and_first_answer_s": round(answered_at - started, 1),
        # the kubelet marks Ready on the readiness probe's cadence, after the pod already answers
        "ready_after_first_answer_s": round(conditions["Ready"] - answered_at, 1),
        "timestamps_resolution_s": 1,
    }
    return out


def cold_start(node: RealNode, doc: dict[str, Any]) -> dict[str, Any]:
    name = doc["metadata"]["name"]
    node.kubectl("delete", "embeddingdeployment", name, "--ignore-not-found", "--wait=true", timeout=300)
    wait_until(lambda: not all_runtimes(node, name), 300, f"{name}'s pods gone")
    t0 = time.time()
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    took = first_answer(node, name, doc["spec"]["model"]["servedModelName"], t0)
    wait_until(lambda: [p for p in all_runtimes(node, name) if is_ready(p)], 120, f"{name} Ready")
    return phases(node, name, t0, t0 + took)


def memory(node: RealNode) -> dict[str, float]:
    """Working-set MiB per container name (chart workloads and runtimes), from the CRI."""
    stats = json.loads(node.crictl("stats", "-o", "json"))
    names = {c["id"]: c["labels"].get("io.kubernetes.container.name", "?")
             for c in json.loads(node.crictl("ps", "-o", "json"))["containers"]}
    out: dict[str, float] = {}
    for s in stats.get("stats", []):
        name = names.get(s["attributes"]["id"], "?")
        mib = int(s.get("memory", {}).get("workingSetBytes", {}).get("value", 0)) / 2**20
        out[name] = round(max(out.get(name, 0.0), mib), 1)
    return out


def image_sizes() -> dict[str, int]:
    done = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"],
                          capture_output=True, text=True, env={"CONTAINERS_STORAGE_CONF":
                                                                str(realnode_home() / "storage.conf"),
                                                                "PATH": "/usr/bin:/bin"})
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines()
            if "embedfleet" in line}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_dir(parser, "realnode-coldstart-cpu.jsonl")
    args = parser.parse_args()
    home = realnode_home()
    with installed_node("realnode-bench-", home / "nodecache") as (node, work):
        doc = example()
        doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1,
                                      "scaleDown": {"stabilizationWindowSeconds": 5}}
        rows: dict[str, Any] = {"present": cold_start(node, doc)}
        # the runtime image out of containerd, then back in: what a pull would cost, without a registry
        image = next(c["image"] for p in all_runtimes(node, doc["metadata"]["name"])
                     for c in p["spec"]["containers"] if c["name"] == "runtime")
        node.kubectl("delete", "embeddingdeployment", doc["metadata"]["name"], "--wait=true", timeout=300)
        wait_until(lambda: not all_runtimes(node, doc["metadata"]["name"]), 300, "pods gone")
        sock = home / "containerd" / "containerd.sock"
        subprocess.run(["ctr", "--address", str(sock), "-n", "k8s.io", "images", "rm", image], check=True,
                       capture_output=True)
        (home / "images").mkdir(exist_ok=True)
        for f in (home / "images").glob("*runtime*.id"):
            f.unlink()  # realnode.sh's record of what containerd holds
        t0 = time.time()
        subprocess.run(["bash", str(SCRIPT), "load"], check=True, capture_output=True)
        imported_s = time.time() - t0
        rows["imported"] = cold_start(node, doc)
        rows["imported"]["image_import_s"] = round(imported_s, 1)
        served = ModelServer(work)
        try:
            http = http_deployment("minilm-http", served.url, served.digest)
            rows["download"] = cold_start(node, http)
            wait_until(lambda: any(k.startswith("cache.embedfleet.dev/") for k in
                                 node.get("node", "realnode-1")["metadata"]["labels"]), 300, "cache label")
            rows["cached"] = cold_start(node, http)
            node.kubectl("delete", "embeddingdeployment", "minilm-http", "--wait=true", timeout=300)
        finally:
            served.close()
        name = doc["metadata"]["name"]
        node.kubectl("patch", "embeddingdeployment", name, "--type", "merge", "-p",
                     '{"spec":{"autoscaling":{"minReplicas":0,"scaleToZero":true,"scaleToZeroGraceSeconds":5}}}')
        mem = memory(node)
        wait_until(lambda: not all_runtimes(node, name), 600, "scaled to zero")
        t0 = time.time()
        reply = embed(gateway_ip(node), GATEWAY_PORT, ["wake up"], timeout=600)
        rows["wake"] = {"total_s": round(time.time() - t0, 2), "status": reply.status_code}
        result = {
            "bench": "realnode_coldstart",
            "rows": rows,
            "cached_over_download": round(rows["cached"]["total_s"] / rows["download"]["total_s"], 3),
            "present_over_imported": round(rows["present"]["total_s"] /
                                           (rows["imported"]["total_s"] + rows["imported"]["image_import_s"]), 3),
            "memory_mib": mem,
            "image_sizes": image_sizes(),
            "selector": runtime_selector(name),
        }
        print(json.dumps(result))
        record("realnode-coldstart", result, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
