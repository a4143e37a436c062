"""Cold starts on the real node (scripts/realnode.sh): from `kubectl apply` to the first answer, phase by phase.

Root only; builds nothing (run `bash scripts/setup.sh --test` as root first). One node, one chart release, then
(`--scenarios`, default all; present, kill and wake `--rounds` times, 3 by default: medians and maxima):
  present   the example (model baked into the image, file://), runtime image already in containerd:
            apply -> the pod's first 200 -> the pod Ready
  imported  the same after removing the runtime image from containerd and importing it again (no registry here:
            the import stands for a pull; its own seconds are reported apart)
  download  an http:// model with pre-pull, node cache empty: the init container downloads and verifies
  cached    the same deployment re-created once the node agent cached the weights: the init container links
  kill      `kill -9` of the Ready pod's runtime process -> its first 200 again -> the pod Ready again
  crash     the same deployment with `runtime.standby: true`, `kill -9` of its serving process (the standby
            parent's child; what an OOM kill or a crash does) -> its first 200 and /ready again, whether the
            pod stayed Ready and the container unrestarted; and the runtime container's memory with and
            without the standby parent
  wake      scaled to zero, one request through the gateway's hold until it is answered
The first answer and Ready are seen from here, to a fraction of a second: the pod's IP polled every 20 ms,
and a `kubectl get pods -w` whose events are stamped on arrival. Each cold start also keeps the Pod's own
timestamps (whole seconds: scheduling, sandbox and image, the init container's weights) and the runtime's
own (GET /load `startup`, to the millisecond: process start -> ready, engine load, warm-up). Also the
images' sizes and each workload's memory (containerd's working set). The row is set beside the newest row
of another commit in the same log (`baseline`, with this run's medians over it). One JSON line, also
appended to bench/results/realnode-coldstart-cpu.jsonl.

    sudo .venv/bin/python bench/realnode_coldstart.py [--rounds 3] [--scenarios present,kill,wake]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), *(str(ROOT / p) for p in ("runtime", "operator", "client", "gateway"))]

import httpx  # noqa: E402
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
    restarts,
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

from _common import add_results_dir, read_rows, record, run_meta  # noqa: E402


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


class PodWatch:
    """`kubectl get pods -w` on one selector, each event stamped with this machine's clock when it arrived:
    when a pod got its IP, turned Ready, restarted, as seen a fraction of a second after the API server had
    it (the Pod's own timestamps are whole seconds)."""

    FIELDS = ("{.object.metadata.name}|{.object.status.podIP}|"
              "{.object.status.conditions[?(@.type==\"Ready\")].status}|"
              "{.object.status.containerStatuses[*].restartCount}|{.object.metadata.deletionTimestamp}{\"\\n\"}")

    def __init__(self, node: RealNode, selector: str) -> None:
        self.events: list[tuple[float, str, str, bool, int, bool]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([str(node.bin / "kubectl"), f"--kubeconfig={node.kubeconfig}", "get", "pods",
                                      "-n", "default", "-l", selector, "-w", "--output-watch-events",
                                      "-o", f"jsonpath={self.FIELDS}"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        time.sleep(1.0)  # kubectl's list and watch open before anything the caller times happens

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            at = time.time()
            parts = line.rstrip("\n").split("|")
            if len(parts) != 5:
                continue
            name, ip, ready, counts, deleting = parts
            restarts = sum(int(c) for c in counts.split() if c.isdigit())
            with self._lock:
                self.events.append((at, name, ip, ready == "True", restarts, bool(deleting)))

    def first(self, since: float, test: Callable[[str, str, bool, int, bool], bool]) -> tuple[float, str, str] | None:
        """The first event after `since` that passes `test(name, ip, ready, restarts, deleting)`: (when,
        name, ip)."""
        with self._lock:
            for at, name, ip, ready, restarts, deleting in self.events:
                if at >= since and test(name, ip, ready, restarts, deleting):
                    return at, name, ip
        return None

    def wait(self, since: float, test: Callable[[str, str, bool, int, bool], bool], what: str,
             timeout: float = 600) -> tuple[float, str, str]:
        return wait_until(lambda: self.first(since, test), timeout, what, interval=0.02)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def answered_at(ip: str, model: str, timeout: float = 900) -> float:
    """When `ip` first answered a 200 (polled every 20 ms; a refused connection costs nothing)."""
    def answered() -> float | None:
        try:
            if embed(ip, RUNTIME_PORT, ["cold start"], timeout=5, model=model).status_code == 200:
                return time.time()
        except httpx.HTTPError:  # not listening yet, or the process was just killed
            pass
        return None

    return wait_until(answered, timeout, f"a first 200 from {ip}", interval=0.02)


def listening(ip: str) -> bool:
    """Whether the runtime port at `ip` takes a connection now."""
    try:
        with socket.create_connection((ip, RUNTIME_PORT), timeout=0.5):
            return True
    except OSError:
        return False


def startup(ip: str) -> dict[str, Any]:
    """The runtime's own cold start, to the millisecond (GET /load `startup`: process start -> ready, its
    engine load and warm-up)."""
    doc = httpx.get(f"http://{ip}:{RUNTIME_PORT}/load", timeout=10).json().get("startup") or {}
    return {k: v for k, v in (doc.get("phases") or {}).items() if k in ("engine_load", "warmup", "ready")}


def phases(node: RealNode, name: str, t0: float, answered: float) -> dict[str, Any]:
    """The Pod's own timestamps (whole seconds): scheduling, sandbox and image, weights (the init container)."""
    pod = next(p for p in all_runtimes(node, name) if is_ready(p))
    conditions = {c["type"]: stamp(c.get("lastTransitionTime")) for c in pod["status"]["conditions"]}
    created = stamp(pod["metadata"]["creationTimestamp"])
    init = (pod["status"].get("initContainerStatuses") or [{}])[0].get("state", {}).get("terminated", {})
    runtime = next(c for c in pod["status"]["containerStatuses"] if c["name"] == "runtime")
    started = stamp(runtime.get("state", {}).get("running", {}).get("startedAt"))
    init_start, init_end = stamp(init.get("startedAt")), stamp(init.get("finishedAt"))
    first_started = init_start or started
    return {
        "scheduling_s": round(conditions["PodScheduled"] - created, 1),
        "sandbox_and_image_s": round(first_started - conditions["PodScheduled"], 1),
        "weights_s": round(init_end - init_start, 1) if init_start and init_end else 0.0,
        # the runtime container's start (whole seconds) to the first 200 this client saw
        "container_start_to_first_answer_s": round(answered - started, 1),
        "timestamps_resolution_s": 1,
    }


def cold_start(node: RealNode, doc: dict[str, Any]) -> dict[str, Any]:
    """Delete, apply, and time apply -> the pod's first 200 -> the pod Ready (both seen from here, sub-second)."""
    name = doc["metadata"]["name"]
    node.kubectl("delete", "embeddingdeployment", name, "--ignore-not-found", "--wait=true", timeout=300)
    wait_until(lambda: not all_runtimes(node, name), 300, f"{name}'s pods gone")
    watch = PodWatch(node, runtime_selector(name))
    try:
        t0 = time.time()
        node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        _, pod, ip = watch.wait(t0, lambda n, ip, r, c, d: bool(ip) and not d, f"{name}'s pod IP")
        answered = answered_at(ip, doc["spec"]["model"]["servedModelName"])
        ready, _, _ = watch.wait(t0, lambda n, ip_, r, c, d: n == pod and r and not d, f"{name} Ready")
    finally:
        watch.close()
    return {"apply_to_first_answer_s": round(answered - t0, 2), "first_answer_to_ready_s": round(ready - answered, 2),
            "apply_to_ready_s": round(ready - t0, 2), "runtime": startup(ip), **phases(node, name, t0, answered)}


def killed(node: RealNode, name: str, model: str) -> dict[str, Any]:
    """`kill -9` of the runtime process of the Ready pod: kill -> its first 200 again -> the pod Ready again."""
    pod = next(p for p in all_runtimes(node, name) if is_ready(p))
    before, ip, pod_name = restarts(pod), pod["status"]["podIP"], pod["metadata"]["name"]
    pid = node.container_pid(pod, "runtime")
    watch = PodWatch(node, runtime_selector(name))
    try:
        t0 = time.time()
        subprocess.run(["kill", "-9", str(pid)], check=True)
        wait_until(lambda: not listening(ip), 30, f"{ip} to stop answering", interval=0.01)
        answered = answered_at(ip, model)
        ready, _, _ = watch.wait(t0, lambda n, ip_, r, c, d: n == pod_name and r and c > before,
                                 f"{pod_name} restarted and Ready")
    finally:
        watch.close()
    return {"kill_to_first_answer_s": round(answered - t0, 2), "kill_to_ready_s": round(ready - t0, 2),
            "runtime": startup(ip)}


def server_pid(node: RealNode, pod: dict[str, Any]) -> int:
    """The serving process of a standby runtime: the container's first process's only child."""
    top = node.container_pid(pod, "runtime")
    kids = [int(c) for task in Path(f"/proc/{top}/task").iterdir() for c in (task / "children").read_text().split()]
    assert len(kids) == 1, f"a standby runtime has one server process under its parent {top}: {kids}"
    return kids[0]


def crashed(node: RealNode, name: str, model: str) -> dict[str, Any]:
    """`kill -9` of the serving process of a `--standby` runtime (what an OOM kill or a crash does): kill ->
    its first 200 again, its /ready again; whether the pod stayed Ready and the container unrestarted."""
    pod = next(p for p in all_runtimes(node, name) if is_ready(p))
    before, ip, pod_name = restarts(pod), pod["status"]["podIP"], pod["metadata"]["name"]
    pid = server_pid(node, pod)
    watch = PodWatch(node, runtime_selector(name))
    try:
        t0 = time.time()
        subprocess.run(["kill", "-9", str(pid)], check=True)
        answered = answered_at(ip, model)
        ready = wait_until(lambda: _ready_at(ip), 300, f"{ip}/ready", interval=0.02)
        time.sleep(6.0)  # past the readiness probe's failure window (5 s): would the pod have turned NotReady?
        dropped = watch.first(t0, lambda n, ip_, r, c, d: n == pod_name and not r and not d)
        restarted = watch.first(t0, lambda n, ip_, r, c, d: n == pod_name and c > before)
    finally:
        watch.close()
    return {"kill_to_first_answer_s": round(answered - t0, 2), "kill_to_ready_s": round(ready - t0, 2),
            "pod_stayed_ready": dropped is None, "container_restarted": restarted is not None,
            "runtime": startup(ip)}


def _standby_pod(node: RealNode, pod: dict[str, Any]) -> bool:
    """Whether this runtime pod runs under a standby parent (its first process has a child)."""
    try:
        server_pid(node, pod)
    except (AssertionError, OSError, subprocess.CalledProcessError):
        return False
    return True


def _ready_at(ip: str) -> float | None:
    try:
        return time.time() if httpx.get(f"http://{ip}:{RUNTIME_PORT}/ready", timeout=2).status_code == 200 else None
    except httpx.HTTPError:
        return None


def woken(node: RealNode, name: str) -> dict[str, Any]:
    """Scaled to zero: one request through the gateway, held until a replica answers it."""
    wait_until(lambda: not all_runtimes(node, name), 600, "scaled to zero")
    t0 = time.time()
    reply = embed(gateway_ip(node), GATEWAY_PORT, ["wake up"], timeout=600)
    return {"wake_s": round(time.time() - t0, 2), "status": reply.status_code}


def summary(rounds: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """Median and maximum over the rounds of each figure in `keys`, and every round."""
    out: dict[str, Any] = {}
    for key in keys:
        values = [r[key] for r in rounds]
        out[key] = {"median": round(statistics.median(values), 2), "max": round(max(values), 2), "all": values}
    out["rounds"] = rounds
    return out


def baseline(path: Path, commit: str) -> dict[str, Any] | None:
    """The figures of the newest row of another commit in this log: what this run is set beside."""
    rows = [r for r in read_rows(path) if r.get("bench") == "realnode_coldstart" and r.get("commit") != commit]
    if not rows:
        return None
    last = rows[-1]
    found = last.get("rows", {})
    present, wake = found.get("present", {}), found.get("wake", {})
    figures = {
        "apply_to_first_answer_s": (present.get("apply_to_first_answer_s") or {}).get("median",
                                                                                      present.get("total_s")),
        "first_answer_to_ready_s": (present.get("first_answer_to_ready_s") or {}).get(
            "median", present.get("ready_after_first_answer_s")),
        "wake_s": (wake.get("wake_s") or {}).get("median", wake.get("total_s")),
        "kill_to_ready_s": ((found.get("kill") or {}).get("kill_to_ready_s") or {}).get("median"),
    }
    return {"commit": last.get("commit"), "date": last.get("date"), **figures}


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


SCENARIOS = ("present", "imported", "download", "cached", "kill", "crash", "wake")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_dir(parser, "realnode-coldstart-cpu.jsonl")
    parser.add_argument("--rounds", type=int, default=3, help="runs of present, kill and wake (medians, maxima)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--note", default="", help="a word on the conditions of this run, kept in the row")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if unknown := set(chosen) - set(SCENARIOS):
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    home = realnode_home()
    rows: dict[str, Any] = {}
    with installed_node("realnode-bench-", home / "nodecache") as (node, work):
        doc = example()
        name, model = doc["metadata"]["name"], doc["spec"]["model"]["servedModelName"]
        doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1,
                                      "scaleDown": {"stabilizationWindowSeconds": 5}}
        if "present" in chosen:
            rows["present"] = summary([cold_start(node, doc) for _ in range(args.rounds)],
                                      ("apply_to_first_answer_s", "first_answer_to_ready_s", "apply_to_ready_s"))
        if "imported" in chosen:
            rows["imported"] = imported(node, home, doc)
        if "download" in chosen or "cached" in chosen:
            rows.update(download_and_cached(node, work, chosen))
        if "kill" in chosen:
            node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
            wait_until(lambda: [p for p in all_runtimes(node, name) if is_ready(p)], 600, f"{name} Ready")
            rounds = []
            for i in range(args.rounds):
                if i:  # a new pod each round: the kubelet's restart back-off (10 s, doubling) is per container
                    node.kubectl("delete", "pod", "-n", "default", "-l", runtime_selector(name), "--wait=true",
                                 timeout=300)
                    wait_until(lambda: [p for p in all_runtimes(node, name) if is_ready(p)], 600, f"{name} Ready")
                rounds.append(killed(node, name, model))
            rows["kill"] = summary(rounds, ("kill_to_first_answer_s", "kill_to_ready_s"))
        mem = memory(node)
        if "crash" in chosen:
            standby = {**doc, "spec": {**doc["spec"], "runtime": {**doc["spec"]["runtime"], "standby": True}}}
            node.kubectl("apply", "-f", "-", input=yaml.safe_dump(standby))
            wait_until(lambda: [p for p in all_runtimes(node, name) if is_ready(p) and _standby_pod(node, p)], 600,
                       f"{name} Ready with --standby")
            rounds = [crashed(node, name, model) for _ in range(args.rounds)]
            rows["crash"] = summary(rounds, ("kill_to_first_answer_s", "kill_to_ready_s"))
            rows["crash"]["memory_mib"] = {"plain": mem.get("runtime"), "standby": memory(node).get("runtime")}
            node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        if "wake" in chosen:
            node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
            node.kubectl("patch", "embeddingdeployment", name, "--type", "merge", "-p",
                         '{"spec":{"autoscaling":{"minReplicas":0,"scaleToZero":true,"scaleToZeroGraceSeconds":5}}}')
            rows["wake"] = summary([woken(node, name) for _ in range(args.rounds)], ("wake_s",))
        result: dict[str, Any] = {"bench": "realnode_coldstart", "rounds": args.rounds, "rows": rows,
                                  "memory_mib": mem, "image_sizes": image_sizes(), "selector": runtime_selector(name)}
        if args.note:
            result["note"] = args.note
        meta = run_meta()
        before = baseline(args.results_dir / "realnode-coldstart-cpu.jsonl", meta["commit"])
        if before is not None:
            result["baseline"] = before
            for key, row in (("apply_to_first_answer_s", "present"), ("first_answer_to_ready_s", "present"),
                             ("wake_s", "wake"), ("kill_to_ready_s", "kill")):
                if before.get(key) and key in rows.get(row, {}):
                    result[f"{key}_over_baseline"] = round(rows[row][key]["median"] / before[key], 3)
        print(json.dumps(result))
        record("realnode-coldstart", result, results_dir=args.results_dir)
    return 0


def imported(node: RealNode, home: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """The runtime image out of containerd, then back in (what a pull would cost, without a registry), then
    one cold start."""
    name = doc["metadata"]["name"]
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    wait_until(lambda: all_runtimes(node, name), 300, f"{name}'s pod")
    image = next(c["image"] for p in all_runtimes(node, name) for c in p["spec"]["containers"]
                 if c["name"] == "runtime")
    node.kubectl("delete", "embeddingdeployment", name, "--wait=true", timeout=300)
    wait_until(lambda: not all_runtimes(node, name), 300, "pods gone")
    sock = home / "containerd" / "containerd.sock"
    subprocess.run(["ctr", "--address", str(sock), "-n", "k8s.io", "images", "rm", image], check=True,
                   capture_output=True)
    (home / "images").mkdir(exist_ok=True)
    for f in (home / "images").glob("*runtime*.id"):
        f.unlink()  # realnode.sh's record of what containerd holds
    t0 = time.time()
    subprocess.run(["bash", str(SCRIPT), "load"], check=True, capture_output=True)
    row = cold_start(node, doc)
    row["image_import_s"] = round(time.time() - t0 - row["apply_to_ready_s"], 1)
    return row


def download_and_cached(node: RealNode, work: Path, chosen: list[str]) -> dict[str, Any]:
    """An http:// model with pre-pull: the init container downloads it (node cache empty), then, once the node
    agent cached it, the same deployment again (the init container links the cache's copy)."""
    out: dict[str, Any] = {}
    served = ModelServer(work)
    try:
        http = http_deployment("minilm-http", served.url, served.digest)
        out["download"] = cold_start(node, http)
        if "cached" in chosen:
            wait_until(lambda: any(k.startswith("cache.embedfleet.dev/") for k in
                                   node.get("node", "realnode-1")["metadata"]["labels"]), 300, "cache label")
            out["cached"] = cold_start(node, http)
            out["cached_over_download"] = round(out["cached"]["apply_to_ready_s"]
                                                / out["download"]["apply_to_ready_s"], 3)
        node.kubectl("delete", "embeddingdeployment", "minilm-http", "--wait=true", timeout=300)
    finally:
        served.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
