"""The node agent (`embedfleet cache agent`): its pure decisions under hypothesis, its cache root as a
real non-root process sees it, and the whole path on a real control plane (chart installed, operator
running as the chart's ServiceAccount, one agent process per kwok node as the chart's node-agent
ServiceAccount, the real kube-scheduler placing runtime pods)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from file_server import serve_files
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.kube.controlplane import ROOT as REPO
from tests.kube.controlplane import Cluster, wait_until
from tests.kube.operator_proc import BENIGN, render_chart
from tests.operator.real import release, small

from embedfleet.operator.cache.digest import tree_digest
from embedfleet.operator.cache.wanted import (
    Want,
    cache_node_counts,
    label_patch,
    node_selected,
    plan,
    wanted_entries,
)
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import NodePool
from embedfleet.operator.platform import PlatformPolicy

AGENT_UID = 10001
DIGESTS = ["sha256:" + c * 64 for c in "0123abcd"]
NAMESPACES = ["team-a", "team-b", "ml"]
LABEL_POOL = {"pool": ["cpu", "gpu"], "zone": ["a", "b"]}
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"


# ---------------------------------------------------------------- pure decisions (hypothesis)

selectors = st.dictionaries(st.sampled_from(sorted(LABEL_POOL)), st.sampled_from(["cpu", "gpu", "a", "b"]),
                            max_size=2)
node_labels = st.builds(
    lambda pool, zone, cp, extra: {**({"pool": pool} if pool else {}), **({"zone": zone} if zone else {}),
                                   **({CONTROL_PLANE: ""} if cp else {}), **extra},
    st.sampled_from([None, "cpu", "gpu"]), st.sampled_from([None, "a", "b"]), st.booleans(),
    st.dictionaries(st.sampled_from([naming.CACHE_LABEL_PREFIX + "old", "other/label"]), st.just("ready"),
                    max_size=2),
)


@st.composite
def specs(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """(kind, object) for an EmbeddingDeployment or ModelCache, sometimes invalid or being deleted."""
    kind = draw(st.sampled_from(["ed", "mc"]))
    namespace = draw(st.sampled_from(NAMESPACES))
    digest = draw(st.sampled_from(DIGESTS))
    meta: dict[str, Any] = {"name": draw(st.sampled_from(["a", "b", "c"])), "namespace": namespace}
    if draw(st.integers(0, 9)) == 0:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    pools = draw(st.lists(selectors, max_size=2))
    cache = {"nodeSelector": draw(selectors),
             "nodePools": [{"name": f"p{i}", "nodeSelector": sel} for i, sel in enumerate(pools)]}
    model: dict[str, Any] = {"source": f"https://weights.example/{digest[7:15]}.tar", "digest": digest}
    if draw(st.integers(0, 9)) == 0:
        model["source"] = "s3://bucket/x"  # invalid: the operator refuses it, so the agent must too
    if kind == "ed":
        spec = {"model": model, "cache": {**cache, "prePull": draw(st.booleans())}}
    else:
        spec = {"model": model, **cache}
    return kind, {"metadata": meta, "spec": spec}


def _valid(obj: dict[str, Any]) -> bool:
    return "deletionTimestamp" not in obj["metadata"] and not obj["spec"]["model"]["source"].startswith("s3")


def _pools_of(kind: str, spec: dict[str, Any]) -> tuple[dict[str, str], list[NodePool]]:
    cache = spec["cache"] if kind == "ed" else spec
    return cache["nodeSelector"], [NodePool.model_validate(p) for p in cache["nodePools"]]


@settings(max_examples=150, deadline=None)
@given(labels=node_labels, objects=st.lists(specs(), max_size=6), allow_cp=st.booleans(), seed=st.randoms())
def test_wanted_entries_are_exactly_the_valid_specs_that_select_this_node(
    labels: dict[str, str], objects: list[tuple[str, dict[str, Any]]], allow_cp: bool, seed: Any
) -> None:
    policy = PlatformPolicy(allowed_images=["*"], allow_control_plane=allow_cp)
    eds = [o for k, o in objects if k == "ed"]
    mcs = [o for k, o in objects if k == "mc"]
    wanted = wanted_entries(labels, eds, mcs, policy)

    expected: set[tuple[str, str]] = set()
    for kind, obj in objects:
        spec = obj["spec"]
        if not _valid(obj) or (kind == "ed" and not spec["cache"]["prePull"]):
            continue
        selector, pools = _pools_of(kind, spec)
        if CONTROL_PLANE in labels and not allow_cp:
            continue
        all_pools = pools or [NodePool(name="default", node_selector=selector)]
        if any(all(labels.get(k) == v for k, v in p.node_selector.items()) for p in all_pools):
            expected.add((obj["metadata"]["namespace"], spec["model"]["digest"]))
    assert {(w.namespace, w.digest) for w in wanted.values()} == expected
    for name, want in wanted.items():
        assert name == naming.cache_entry(want.namespace, want.digest) == want.entry
    if CONTROL_PLANE in labels and not allow_cp:
        assert wanted == {}
    # The list order the API server happens to return changes nothing.
    shuffled_eds, shuffled_mcs = list(eds), list(mcs)
    seed.shuffle(shuffled_eds)
    seed.shuffle(shuffled_mcs)
    assert wanted_entries(labels, shuffled_eds, shuffled_mcs, policy) == wanted


def _want(entry_index: int) -> Want:
    return Want(NAMESPACES[entry_index % 3], DIGESTS[entry_index % 8], f"https://w.example/{entry_index % 8}")


entries = st.sets(st.integers(0, 23), max_size=8)


@settings(max_examples=200, deadline=None)
@given(wanted_ids=entries, disk=st.dictionaries(st.integers(0, 23), st.booleans(), max_size=8),
       ages=st.dictionaries(st.integers(0, 23), st.floats(0, 100), max_size=8),
       retention=st.floats(0, 60), now=st.floats(100, 1000))
def test_plan_pulls_missing_keeps_unwanted_for_the_retention_then_deletes(
    wanted_ids: set[int], disk: dict[int, bool], ages: dict[int, float], retention: float, now: float
) -> None:
    wanted = {_want(i).entry: _want(i) for i in wanted_ids}
    on_disk = {_want(i).entry: ready for i, ready in disk.items()}
    memory = {_want(i).entry: now - age for i, age in ages.items()}
    decided = plan(wanted, on_disk, memory, now, retention)
    assert {w.entry for w in decided.pull} == {n for n in wanted if not on_disk.get(n)}
    unwanted = set(on_disk) - set(wanted)
    assert set(decided.delete) | set(decided.unwanted_since) == unwanted
    assert not set(decided.delete) & set(decided.unwanted_since)
    for name in unwanted:
        since = memory.get(name, now)
        assert (name in decided.delete) == (now - since >= retention)
        if name in decided.unwanted_since:
            assert decided.unwanted_since[name] == since  # the clock never restarts while unwanted


@settings(max_examples=50, deadline=None)
@given(retention=st.integers(1, 50), step=st.integers(1, 10), passes=st.integers(1, 30))
def test_an_unwanted_entry_is_deleted_at_the_first_pass_after_its_retention(
    retention: int, step: int, passes: int
) -> None:
    entry = _want(0).entry
    memory: dict[str, float] = {}
    start = 1000.0
    for n in range(passes):
        now = start + n * step
        decided = plan({}, {entry: True}, memory, now, retention)
        if decided.delete:
            assert now - start >= retention and now - step - start < retention
            break
        memory = decided.unwanted_since
        assert now - start < retention


@settings(max_examples=200, deadline=None)
@given(wanted_ids=entries, ready_ids=entries, current=st.dictionaries(
    st.sampled_from([_want(i).label for i in range(24)] + [naming.CACHE_LABEL_PREFIX + "sha256-" + "a" * 16,
                                                          "pool", "kubernetes.io/hostname"]),
    st.sampled_from(["ready", "x"]), max_size=6))
def test_label_patch_leaves_exactly_the_ready_wanted_labels_and_is_idempotent(
    wanted_ids: set[int], ready_ids: set[int], current: dict[str, str]
) -> None:
    wanted = {_want(i).entry: _want(i) for i in wanted_ids}
    ready = [_want(i).entry for i in ready_ids]
    patch = label_patch(wanted, ready, current)
    after = {k: v for k, v in {**current, **patch}.items() if v is not None}
    expected = {w.label: "ready" for name, w in wanted.items() if name in ready}
    assert {k: v for k, v in after.items() if k.startswith(naming.CACHE_LABEL_PREFIX)} == expected
    assert {k: v for k, v in after.items() if not k.startswith(naming.CACHE_LABEL_PREFIX)} == {
        k: v for k, v in current.items() if not k.startswith(naming.CACHE_LABEL_PREFIX)}
    assert label_patch(wanted, ready, after) == {}  # steady state writes nothing


@settings(max_examples=100, deadline=None)
@given(nodes=st.lists(node_labels, max_size=6), selector=selectors, pools=st.lists(selectors, max_size=2),
       allow_cp=st.booleans(), namespace=st.sampled_from(NAMESPACES))
def test_cache_status_counts_the_nodes_the_agents_serve(
    nodes: list[dict[str, str]], selector: dict[str, str], pools: list[dict[str, str]], allow_cp: bool,
    namespace: str,
) -> None:
    digest = DIGESTS[0]
    node_pools = [NodePool(name=f"p{i}", node_selector=s) for i, s in enumerate(pools)]
    key = naming.cache_label_key(digest, namespace)
    objects = [{"metadata": {"labels": {**labels, **({key: "ready"} if i % 2 else {})}}}
               for i, labels in enumerate(nodes)]
    cached, total = cache_node_counts(objects, namespace, digest, selector, node_pools, allow_cp)
    selected = [o for o in objects if node_selected(o["metadata"]["labels"], selector, node_pools, allow_cp)]
    assert total == len(selected)
    assert cached == sum(1 for o in selected if o["metadata"]["labels"].get(key) == "ready") <= total


# ---------------------------------------------------------------- a real non-root agent and its cache root


#: How a test runs a process as the agent's uid: either a plain user switch, or, where the checkout
#: lives under a directory only root may enter (a CI clone in a 0700 temp dir), setpriv with the one
#: capability CAP_DAC_READ_SEARCH (read and traverse anything). That capability never grants a write,
#: so a root-owned 0755 cache root still refuses the process, which is what these tests are about.
AgentRunner = tuple[list[str], dict[str, object]]


def _as_uid_plain() -> AgentRunner:
    return [], {"user": AGENT_UID, "group": AGENT_UID, "extra_groups": []}


def _as_uid_reading_everything() -> AgentRunner | None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [setpriv, f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups",
            "--inh-caps=-all,+dac_read_search", "--ambient-caps=-all,+dac_read_search"], {}


def _agent_python(tmp: Path) -> tuple[list[str], dict[str, object]] | None:
    """(argv prefix ending in an interpreter, subprocess kwargs) that run as uid 10001 with this checkout
    and its dependencies importable, or None."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    path = os.pathsep.join([str(REPO / d) for d in ("runtime", "operator", "client")] + site)
    for runner in (_as_uid_plain(), _as_uid_reading_everything()):
        if runner is None:
            continue
        prefix, kwargs = runner
        for python in (sys.executable, "/usr/bin/python3.11", shutil.which("python3") or ""):
            if not python or not os.path.exists(python):
                continue
            try:
                done = subprocess.run(
                    [*prefix, python, "-c", "import embedfleet.operator.cache.agent, kubernetes, httpx, pydantic"],
                    capture_output=True, timeout=120, cwd=tmp,
                    env={"PATH": "/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": path}, **kwargs)  # type: ignore[arg-type]
            except OSError:  # e.g. the interpreter lives under a directory only root may enter
                continue
            if done.returncode == 0:
                return [*prefix, python], kwargs
    return None


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temp dir uid 10001 can traverse (pytest's own tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="embedfleet-agent-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def as_agent(shared_tmp: Path):
    """Run `embedfleet cache ...` as uid/gid 10001 (like the chart's agent container); skipped where this
    machine cannot switch users."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as uid 10001")
    found = _agent_python(shared_tmp)
    if found is None:
        pytest.skip("no Python interpreter that uid 10001 can run with this checkout's dependencies")
    python, as_uid = found
    site = [p for p in sys.path if p.endswith("site-packages")]
    path = os.pathsep.join([str(REPO / d) for d in ("runtime", "operator", "client")] + site)

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*python, "-m", "embedfleet.runtime.cli", "cache", *args], **as_uid,  # type: ignore[arg-type]
                              capture_output=True, text=True, timeout=timeout,
                              cwd=shared_tmp, env={"PATH": "/usr/bin:/bin", "HOME": str(shared_tmp),
                                                   "PYTHONPATH": path, **(env or {})})

    run.python = python  # type: ignore[attr-defined]
    run.as_uid = as_uid  # type: ignore[attr-defined]
    return run


def prepare_with_chown_only(root: Path) -> subprocess.CompletedProcess:
    """`embedfleet cache prepare` as root with every capability but CAP_CHOWN gone (the chart's init
    container), through setpriv when it is there, else as plain root."""
    argv = [sys.executable, "-m", "embedfleet.runtime.cli", "cache", "prepare", "--cache-root", str(root),
            "--owner", f"{AGENT_UID}:{AGENT_UID}"]
    setpriv = shutil.which("setpriv")
    if setpriv:
        argv = [setpriv, "--bounding-set=-all,+chown", "--inh-caps=-all", *argv]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("runtime", "operator", "client"))}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_non_root_agent_needs_prepare_and_then_replaces_root_owned_entries(as_agent, shared_tmp: Path) -> None:
    root = shared_tmp / "cache"
    root.mkdir(mode=0o755)  # what the kubelet creates for a missing hostPath: root-owned, 0755
    refused = as_agent("agent", "--node-name", "n1", "--cache-root", str(root), "--once")
    assert refused.returncode == 2
    assert "owned by uid 0" in refused.stderr and "embedfleet cache prepare" in refused.stderr, refused.stderr
    assert "init container" in refused.stderr

    # Leftovers of the older root-run puller, and an empty entry the kubelet made for a runtime pod.
    src = shared_tmp / "src"
    src.mkdir()
    (src / "config.json").write_text('{"hidden_size": 8}')
    (src / "weights.bin").write_bytes(os.urandom(2048))
    digest = tree_digest(src)
    legacy = root / f"sha256-{digest[7:]}"
    legacy.mkdir()
    (legacy / "weights.bin").write_bytes(b"old")
    kubelet_made = root / naming.cache_entry("ml", digest)
    kubelet_made.mkdir(mode=0o755)
    done = prepare_with_chown_only(root)
    assert done.returncode == 0, done.stderr
    assert (root.stat().st_uid, root.stat().st_gid, root.stat().st_mode & 0o777) == (AGENT_UID, AGENT_UID, 0o755)
    assert (legacy / "weights.bin").stat().st_uid == AGENT_UID
    kubelet_made.chmod(0o755)
    os.chown(kubelet_made, 0, 0)  # the kubelet may make it again after prepare ran: still replaceable

    code = ("import sys; from pathlib import Path; from embedfleet.operator.cache.pull import pull; "
            f"r = pull('file://{src}', '{digest}', Path('{root}'), entry='{kubelet_made.name}'); print(r.path)")
    done = subprocess.run([*as_agent.python, "-c", code], **as_agent.as_uid,
                          capture_output=True, text=True, timeout=120, cwd=shared_tmp,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(shared_tmp), "PYTHONPATH": os.pathsep.join(
                              [str(REPO / d) for d in ("runtime", "operator", "client")]
                              + [p for p in sys.path if p.endswith("site-packages")])})
    assert done.returncode == 0, done.stderr
    assert kubelet_made.stat().st_uid == AGENT_UID and (kubelet_made / ".ready").read_text().strip() == digest
    assert tree_digest(kubelet_made) == digest

    # A pod's own pull (the runtime's init container) also runs as 10001 and checks sizes.
    pod_cache = shared_tmp / "pod"
    pod_cache.mkdir()
    os.chown(pod_cache, AGENT_UID, AGENT_UID)  # an emptyDir with the pod's fsGroup
    done = as_agent("pull", "--source", f"file://{src}", "--digest", digest, "--cache-dir", str(pod_cache),
                    "--from-node-cache", str(kubelet_made))
    assert done.returncode == 0, done.stderr
    assert (pod_cache / f"sha256-{digest[7:]}").resolve() == kubelet_made.resolve()


# ---------------------------------------------------------------- the whole path on a real control plane


def _labels(cluster: Cluster, node: str) -> dict[str, str]:
    return cluster.get_json("node", node)["metadata"]["labels"]


def _tiny_model(directory: Path) -> str:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"hidden_size": 8, "model_type": "bert"}))
    (directory / "model.safetensors").write_bytes(os.urandom(4096))
    (directory / "tokenizer.json").write_text("{}")
    from embedfleet.operator.cache.digest import MANIFEST_NAME, manifest_lines, render_manifest

    (directory / MANIFEST_NAME).write_bytes(render_manifest(manifest_lines(directory)))
    return tree_digest(directory)


class Agents:
    """One `embedfleet cache agent --once` process per node, each with its own cache root, as the chart's
    node-agent ServiceAccount (its command and env from `helm template`), as uid 10001 when possible."""

    def __init__(self, cluster: Cluster, workdir: Path, release_name: str, namespace: str,
                 sets: dict[str, str], nodes: list[str], as_agent: Any) -> None:
        docs = render_chart(cluster, release_name, namespace, sets=sets)
        (ds,) = [d for d in docs if d.get("kind") == "DaemonSet"]
        pod = ds["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        self.user = f"system:serviceaccount:{namespace}:{pod['serviceAccountName']}"
        token = cluster.token_for(namespace, pod["serviceAccountName"])
        self.kubeconfig = cluster.kubeconfig_for(token, workdir / "agent.kubeconfig", namespace=namespace)
        self.args = [a for a in container["args"] if not a.startswith("--cache-root=")]
        self.env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        self.cluster, self.nodes, self.as_agent = cluster, nodes, as_agent
        self.roots = {node: workdir / f"root-{node}" for node in nodes}
        if as_agent is not None:
            os.chown(self.kubeconfig, AGENT_UID, AGENT_UID)

    def pass_all(self) -> dict[str, subprocess.CompletedProcess]:
        out = {}
        for node, root in self.roots.items():
            args = ["agent", f"--cache-root={root}", *self.args, "--once"]
            env = {**self.env, "NODE_NAME": node, "KUBECONFIG": str(self.kubeconfig)}
            if self.as_agent is not None:
                done = self.as_agent(*args, env=env)
            else:
                done = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "cache", *args],
                                      capture_output=True, text=True, timeout=120,
                                      env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(
                                          str(REPO / d) for d in ("runtime", "operator", "client"))})
            out[node] = done
        return out

    def errors(self) -> list[str]:
        return [str(e) for e in self.cluster.audit() if e.user == self.user and e.code >= 400
                and (e.code, e.verb) not in BENIGN]


def _runtime_pod(cluster: Cluster, name: str, ns: str) -> dict[str, Any] | None:
    pods = cluster.get_json("pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name},"
                            "app.kubernetes.io/component=runtime")["items"]
    return pods[0] if pods and pods[0]["spec"].get("nodeName") else None


def test_node_agents_cache_label_and_retire_on_a_real_cluster(kube_cluster: Cluster, unique: str,
                                                              shared_tmp: Path, request: pytest.FixtureRequest) -> None:
    cluster = kube_cluster
    as_agent = None
    if os.geteuid() == 0 and _agent_python(shared_tmp) is not None:
        as_agent = request.getfixturevalue("as_agent")
    sets = {"nodeAgent.retentionSeconds": "3"}
    nodes = ["cpu-1", "cpu-2", "gpu-1", "gpu-2"]
    gpu_pool = [{"name": "gpu", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}]
    with serve_files() as server, release(cluster, shared_tmp, unique, sets=sets,
                                          env={"EMBEDFLEET_STATUS_INTERVAL": "1"}) as (system_ns, proc):
        assert proc is not None
        digest = _tiny_model(shared_tmp / "model")
        server.publish_dir("/m/", shared_tmp / "model")
        source = server.url + "/m/"
        team_a, team_b = f"team-a-{unique}", f"team-b-{unique}"
        for ns in (team_a, team_b):
            cluster.kubectl("create", "namespace", ns)
        agents = Agents(cluster, shared_tmp, f"ef-{unique}", system_ns, sets, nodes, as_agent)
        for root in agents.roots.values():
            root.mkdir(mode=0o755)  # as the kubelet creates a missing hostPath
        if as_agent is not None:
            refused = agents.pass_all()["cpu-1"]
            assert refused.returncode == 2 and "embedfleet cache prepare" in refused.stderr, refused.stderr
            for root in agents.roots.values():
                assert prepare_with_chown_only(root).returncode == 0
            # A runtime pod landed first on gpu-1: the kubelet made the tenant's entry, empty, as root.
            early = agents.roots["gpu-1"] / naming.cache_entry(team_a, digest)
            early.mkdir(mode=0o755)

        cluster.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "ModelCache",
                       "metadata": {"name": "weights", "namespace": team_a},
                       "spec": {"model": {"source": source, "digest": digest}, "nodePools": gpu_pool}})
        results = agents.pass_all()
        for node, done in results.items():
            assert done.returncode == 0, f"{node}: {done.stderr[-3000:]}"
        key_a = naming.cache_label_key(digest, team_a)
        key_b = naming.cache_label_key(digest, team_b)
        for node in nodes:
            entry = agents.roots[node] / naming.cache_entry(team_a, digest)
            if node.startswith("gpu-"):
                assert _labels(cluster, node).get(key_a) == "ready", node
                assert tree_digest(entry) == digest and (entry / ".manifest").is_file()
            else:
                assert key_a not in _labels(cluster, node) and not entry.exists(), node
        if as_agent is not None:
            assert early.stat().st_uid == AGENT_UID  # replaced by the non-root agent
        wait_until(lambda: ((cluster.get_json("modelcache", "weights", "-n", team_a) or {}).get("status") or {})
                   .get("cachedNodes") == 2, 60, "ModelCache cachedNodes 2/2 from the labels")
        mc_status = cluster.get_json("modelcache", "weights", "-n", team_a)["status"]
        assert mc_status["totalNodes"] == 2

        # A pre-pulling deployment of team-a: the real scheduler prefers the labelled GPU nodes.
        model = {"source": source, "digest": digest}
        cluster.apply(small("pre", team_a, model=model, autoscaling={"enabled": False}, replicas=1,
                            cache={"prePull": True, "nodePools": gpu_pool}))
        pod = wait_until(lambda: _runtime_pod(cluster, "pre", team_a), 90, "team-a's runtime pod scheduled")
        assert pod["spec"]["nodeName"] in ("gpu-1", "gpu-2")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "node-cache")
        claim = volume["persistentVolumeClaim"]["claimName"]
        bound = cluster.get_json("pvc", claim, "-n", team_a)  # the pod was scheduled: its claim is bound
        assert bound["status"]["phase"] == "Bound"
        path = cluster.get_json("pv", bound["spec"]["volumeName"])["spec"]["hostPath"]["path"]
        assert path.endswith("/" + naming.cache_entry(team_a, digest))
        # team-b asks for the same digest: no node holds it *for team-b*, so its pod goes anywhere.
        cluster.apply(small("pre", team_b, model=model, autoscaling={"enabled": False}, replicas=1,
                            cache={"prePull": True, "nodePools": [{"name": "none",
                                                                   "nodeSelector": {"pool": "nowhere"}}]}))
        pod_b = wait_until(lambda: _runtime_pod(cluster, "pre", team_b), 90, "team-b's runtime pod scheduled")
        assert pod_b["spec"]["nodeName"] in nodes or pod_b["spec"]["nodeName"]
        assert not any(key_b in _labels(cluster, node) for node in nodes)

        # Tenants hold no node right and nothing cluster-scoped: the only ServiceAccounts are "default".
        from tests.chart.helm import rights

        for ns in (team_a, team_b):
            accounts = [sa["metadata"]["name"] for sa in cluster.get_json("serviceaccounts", "-n", ns)["items"]]
            assert accounts == ["default"]
            for account in accounts:
                assert rights(cluster, f"system:serviceaccount:{ns}:{account}", ns) == set()
                assert cluster.kubectl("auth", "can-i", "patch", "nodes", f"--as=system:serviceaccount:{ns}:{account}",
                                       check=False).stdout.strip() == "no"

        # Deleting team-a's objects: labels go at the next pass, the entry after the retention.
        cluster.kubectl("delete", "modelcache", "weights", "-n", team_a, "--wait=true", "--timeout=60s")
        cluster.kubectl("delete", "embeddingdeployment", "pre", "-n", team_a, "--wait=true", "--timeout=60s")
        agents.pass_all()
        entry_a = agents.roots["gpu-1"] / naming.cache_entry(team_a, digest)
        assert not any(key_a in _labels(cluster, node) for node in nodes)
        assert entry_a.exists()  # kept for the retention: a re-created deployment finds it
        time.sleep(3.5)
        results = agents.pass_all()
        assert all(done.returncode == 0 for done in results.values()), {n: d.stderr[-500:] for n, d in results.items()}
        assert not entry_a.exists()
        assert agents.errors() == [], agents.errors()
        assert proc.alive(), proc.log()[-3000:]
    errors = proc.unexpected_errors()
    assert errors == [], "\n".join(map(str, errors))


def test_a_running_agent_acts_on_a_change_at_once_not_at_its_interval(kube_cluster: Cluster, unique: str,
                                                                       shared_tmp: Path) -> None:
    """The daemon (not --once), as the chart's node-agent identity with a 300 s interval: a ModelCache
    created after its first pass is on disk and labelled within seconds, because its informers' watch woke
    a pass; the audit log shows the watches and no refusal."""
    cluster = kube_cluster
    with serve_files() as server, release(cluster, shared_tmp, f"w{unique}", start=False) as (system_ns, _):
        digest = _tiny_model(shared_tmp / "watch-model")
        server.publish_dir("/w/", shared_tmp / "watch-model")
        ns = f"team-w-{unique}"
        cluster.kubectl("create", "namespace", ns)
        (shared_tmp / "watch").mkdir()
        agents = Agents(cluster, shared_tmp / "watch", f"ef-w{unique}", system_ns, {}, ["cpu-1"], None)
        root = agents.roots["cpu-1"]
        root.mkdir(mode=0o755)
        health = shared_tmp / "watch" / "health"
        args = [a for a in agents.args if not a.startswith(("--interval", "--health-dir"))]
        env = {**os.environ, **agents.env, "NODE_NAME": "cpu-1", "KUBECONFIG": str(agents.kubeconfig),
               "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("runtime", "operator", "client"))}
        cluster.audit_mark()
        proc = subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", "cache", "agent",
                                 f"--cache-root={root}", *args, "--interval=300", f"--health-dir={health}"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            def ready() -> bool:
                assert proc.poll() is None, proc.communicate()[0][-3000:]
                return (health / "ready").exists()

            wait_until(ready, 60, "the agent's first pass")  # its `ready` file: the pass could read the cluster
            time.sleep(3)  # past the pass the informers' first list starts a second after it lands
            cluster.apply({"apiVersion": "embedfleet.dev/v1alpha1", "kind": "ModelCache",
                           "metadata": {"name": "watched", "namespace": ns},
                           "spec": {"model": {"source": server.url + "/w/", "digest": digest}}})
            key = naming.cache_label_key(digest, ns)
            wait_until(lambda: _labels(cluster, "cpu-1").get(key) == "ready", 30,
                       "cached and labelled long before the 300 s interval")
            assert tree_digest(root / naming.cache_entry(ns, digest)) == digest
            assert agents.errors() == [], agents.errors()
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out[-3000:]
        watched = {e.resource for e in cluster.audit() if e.user == agents.user and e.verb == "watch"}
        assert watched == {"modelcaches", "embeddingdeployments"}, watched
        cluster.kubectl("delete", "modelcache", "watched", "-n", ns, "--wait=true", "--timeout=60s")
