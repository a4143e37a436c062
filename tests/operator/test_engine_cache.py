"""Engine builds on the node, the pure and on-disk parts: accelerator names, the folder layout and what
counts as a complete build, which deployments get an engines folder (render and agent alike), the node
labels, the folder's ownership and its size bound."""

from __future__ import annotations

import copy
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peer_helpers import make_build

from embedfleet.operator.cache import engine_sync
from embedfleet.operator.cache.engine_sync import ensure_folder, prune, scan_engines, sync_engines
from embedfleet.operator.cache.engines import (
    ACCELERATOR,
    ENGINES_MOUNT,
    GPU_PRODUCT_LABEL,
    SOURCE_RECORD,
    Build,
    BuildUnavailable,
    build_files,
    cpu_isa_class,
    gpu_accelerator,
    list_builds,
    node_accelerators,
    read_cpu_flags,
)
from embedfleet.operator.cache.wanted import Want, label_patch, wanted_engines, wanted_entries
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.crd.prepull import shares_engine_builds
from embedfleet.operator.platform import PlatformPolicy
from embedfleet.operator.render import render
from embedfleet.operator.render.cache_volumes import volume_manifest, wanted_claims

DIGEST = "sha256:" + "5e" * 32
ROOT = "/var/lib/embedfleet/cache"
BASE: dict[str, Any] = {"model": {"source": "https://weights.example/minilm.tar", "digest": DIGEST}}
LABEL_KEY = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def spec(**sections: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def deployment(namespace: str, raw: dict[str, Any], name: str = "m") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": raw}


# ---------------------------------------------------------------- accelerator names


@settings(max_examples=200, deadline=None)
@given(flags=st.sets(st.sampled_from(["amx_int8", "amx_tile", "avx512_vnni", "avx512f", "avx2", "sse4_2", "sve",
                                      "asimd", "fp"])),
       machine=st.sampled_from(["x86_64", "AMD64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x"]))
def test_every_cpu_class_is_a_valid_accelerator_name(flags: set[str], machine: str) -> None:
    name = cpu_isa_class(flags, machine)
    assert ACCELERATOR.match(name), name
    assert cpu_isa_class(sorted(flags, reverse=True), machine.lower()) == name  # order and case never matter


def test_cpu_classes_follow_the_widest_int8_instructions() -> None:
    assert cpu_isa_class({"avx2", "avx512f", "avx512_vnni", "amx_int8"}, "x86_64") == "cpu-x86_64-amx"
    assert cpu_isa_class({"avx2", "avx512f", "avx512_vnni"}, "x86_64") == "cpu-x86_64-avx512vnni"
    assert cpu_isa_class({"avx2", "avx512f"}, "amd64") == "cpu-x86_64-avx512"
    assert cpu_isa_class({"avx2"}, "x86_64") == "cpu-x86_64-avx2"
    assert cpu_isa_class(set(), "x86_64") == "cpu-x86_64-baseline"
    assert cpu_isa_class({"sve", "asimd"}, "arm64") == "cpu-aarch64-sve"
    assert cpu_isa_class({"asimd"}, "aarch64") == "cpu-aarch64-neon"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t: zz\n")
    assert read_cpu_flags(info) == {"fpu", "avx2", "avx512f"}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert read_cpu_flags(info) == {"fp", "asimd", "sve"}
    assert read_cpu_flags(tmp_path / "missing") == set()


@settings(max_examples=200, deadline=None)
@given(product=st.text(min_size=1, max_size=120))
def test_gpu_names_are_valid_and_read_the_same_from_torch_and_the_node_label(product: str) -> None:
    name = gpu_accelerator(product)
    assert ACCELERATOR.match(name), name
    assert gpu_accelerator(product.replace(" ", "-")) == gpu_accelerator(product.replace("-", " "))


def test_torch_and_gpu_feature_discovery_spell_one_gpu_alike() -> None:
    assert gpu_accelerator("NVIDIA H100 80GB HBM3") == gpu_accelerator("NVIDIA-H100-80GB-HBM3") \
        == "cuda-nvidia-h100-80gb-hbm3"
    assert node_accelerators({GPU_PRODUCT_LABEL: "NVIDIA-L4"}, "cpu-x86_64-avx2") == [
        "cpu-x86_64-avx2", "cuda-nvidia-l4"]
    assert node_accelerators({}, "cpu-x86_64-avx2") == ["cpu-x86_64-avx2"]


@settings(max_examples=200, deadline=None)
@given(namespace=st.from_regex(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", fullmatch=True),
       digest=st.sampled_from(["sha256:" + c * 64 for c in "0a5f"]),
       accel=st.sampled_from(["cpu-x86_64-amx", "cpu-x86_64-avx2", "cuda-nvidia-h100-80gb-hbm3", "cuda-nvidia-l4"]))
def test_engine_labels_are_valid_keys_apart_from_the_weights_labels(namespace: str, digest: str, accel: str) -> None:
    key = naming.engine_label_key(digest, namespace, accel)
    assert LABEL_KEY.match(key), key
    assert key.startswith(naming.CACHE_LABEL_PREFIX) and key != naming.cache_label_key(digest, namespace)
    other = "cuda-nvidia-a10g" if accel != "cuda-nvidia-a10g" else "cpu-x86_64-avx2"
    assert naming.engine_label_key(digest, namespace, other) != key


# ---------------------------------------------------------------- the folder's layout


def test_only_complete_real_builds_are_listed(tmp_path: Path) -> None:
    accel = "cpu-x86_64-avx2"
    make_build(tmp_path, f"{accel}/sha256-0123456789abcdef/int8-cpu-aaaa")
    make_build(tmp_path, f"{accel}/sha256-0123456789abcdef/.int8-cpu-bbbb.x1y2")  # in progress
    (tmp_path / accel / "sha256-0123456789abcdef" / ".int8-cpu-aaaa.lock").write_text("")
    make_build(tmp_path, "cuda-nvidia-l4/m-0123456789abcdef/trtllm-1")
    make_build(tmp_path, "not-an-accelerator/g/b")
    make_build(tmp_path / "elsewhere", "x/y")
    (tmp_path / accel / "sha256-0123456789abcdef" / "planted").symlink_to(tmp_path / "elsewhere" / "x" / "y")
    (tmp_path / "cpu-x86_64-amx").symlink_to(tmp_path / accel)
    assert list_builds(tmp_path) == [Build(accel, "sha256-0123456789abcdef", "int8-cpu-aaaa"),
                                     Build("cuda-nvidia-l4", "m-0123456789abcdef", "trtllm-1")]
    assert list_builds(tmp_path, "cuda-nvidia-l4") == [Build("cuda-nvidia-l4", "m-0123456789abcdef", "trtllm-1")]


def test_a_builds_files_are_plain_files_inside_it(tmp_path: Path) -> None:
    build = make_build(tmp_path, "b", {"model.bin": b"12345", "sub/weights": b"ab"})
    (build / SOURCE_RECORD).write_text("{}")
    files = build_files(build)
    assert [(rel, size) for rel, size, _ in files] == [("model.bin", 5), ("sub/weights", 2)]
    (build / "escape").symlink_to("/etc/passwd")
    with pytest.raises(BuildUnavailable, match="escape"):
        build_files(build)
    (build / "escape").unlink()
    (build / "dir-link").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(BuildUnavailable, match="symlink"):
        build_files(build)
    (build / "dir-link").unlink()
    os.mkfifo(build / "pipe")
    with pytest.raises(BuildUnavailable, match="regular"):
        build_files(build)


# ---------------------------------------------------------------- which deployments share builds


@pytest.mark.parametrize(("raw", "shares"), [
    (spec(cache={"prePull": True}, runtime={"dtype": "int8"}), True),
    (spec(cache={"prePull": True}, runtime={"engine": "trtllm", "gpu": {"count": 1}}), True),
    (spec(cache={"prePull": True}), False),  # float32: nothing is built
    (spec(runtime={"dtype": "int8"}), False),  # no node cache: the pod builds in its own /tmp
    ({"model": {"source": "file:///models/minilm"}, "cache": {"prePull": True}, "runtime": {"dtype": "int8"}},
     False),  # no digest to key the builds by
])
def test_engines_folder_for_pre_pulled_models_whose_runtime_builds(raw: dict[str, Any], shares: bool) -> None:
    parsed = EmbeddingDeploymentSpec.model_validate(raw)
    assert shares_engine_builds(parsed) is shares
    rendered = render("m", "team-a", "uid", parsed)
    manifests = {m["kind"]: m for m in rendered}
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    runtime = pod["containers"][0]
    env = manifests["ConfigMap"]["data"]
    if not shares:
        assert "node-engines" not in volumes and "EMBEDFLEET_ENGINE_CACHE_DIR" not in env
        return
    assert volumes["node-engines"]["persistentVolumeClaim"] == {"claimName": naming.engines_claim(DIGEST)}
    engines = next(c for c in wanted_claims("team-a", rendered) if c.engines)  # the volume behind the claim
    assert volume_manifest(engines, ROOT, "u")["spec"]["hostPath"] == {
        "path": f"{ROOT}/{naming.engines_entry('team-a', DIGEST)}", "type": "DirectoryOrCreate"}
    (mount,) = [m for m in runtime["volumeMounts"] if m["name"] == "node-engines"]
    assert mount == {"name": "node-engines", "mountPath": ENGINES_MOUNT}  # writable: the runtime builds there
    assert env["EMBEDFLEET_ENGINE_CACHE_DIR"] == ENGINES_MOUNT
    for init in pod.get("initContainers", []):  # only the runtime writes builds
        assert all(m["name"] != "node-engines" for m in init["volumeMounts"])


def test_the_agent_keeps_a_folder_exactly_for_those_deployments() -> None:
    policy = PlatformPolicy()
    objs = [deployment("team-a", spec(cache={"prePull": True}, runtime={"dtype": "int8"}), "q"),
            deployment("team-b", spec(cache={"prePull": True}), "f"),
            deployment("team-c", spec(runtime={"dtype": "int8"}), "n"),
            {**deployment("team-d", spec(cache={"prePull": True}, runtime={"dtype": "int8"})),
             "metadata": {"name": "gone", "namespace": "team-d", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
            deployment("team-e", spec(cache={"prePull": True, "nodeSelector": {"pool": "gpu"}},
                                      runtime={"dtype": "int8"}))]
    found = wanted_engines({"pool": "cpu"}, objs, policy)
    assert list(found) == [naming.engines_entry("team-a", DIGEST)]
    assert found[naming.engines_entry("team-a", DIGEST)].namespace == "team-a"
    assert naming.engines_entry("team-e", DIGEST) in wanted_engines({"pool": "gpu"}, objs, policy)
    assert wanted_engines({"node-role.kubernetes.io/control-plane": ""}, objs, policy) == {}
    # the weights are wanted as before, engines folder or not
    assert set(wanted_entries({"pool": "cpu"}, objs, [], policy)) == {
        naming.cache_entry("team-a", DIGEST), naming.cache_entry("team-b", DIGEST)}


def test_engine_labels_join_the_weights_labels_and_stale_ones_go() -> None:
    want = Want("team-a", DIGEST, "https://w")
    engine = naming.engine_label_key(DIGEST, "team-a", "cpu-x86_64-avx2")
    stale = naming.engine_label_key(DIGEST, "team-a", "cuda-nvidia-l4")
    patch = label_patch({want.entry: want}, [want.entry], {stale: "ready"}, [engine])
    assert patch == {want.label: "ready", engine: "ready", stale: None}
    assert label_patch({want.entry: want}, [want.entry], {want.label: "ready", engine: "ready"}, [engine]) == {}


# ---------------------------------------------------------------- the folder on disk


def test_the_agent_owns_the_folder_replacing_what_the_kubelet_made(tmp_path: Path, monkeypatch) -> None:
    name = naming.engines_entry("team-a", DIGEST)
    made = ensure_folder(tmp_path, name)
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o755
    make_build(made, "cpu-x86_64-avx2/g/b")
    assert ensure_folder(tmp_path, name) == made and list_builds(made)  # a writable one is kept as it is
    (tmp_path / "other").mkdir()
    other = naming.engines_entry("team-b", DIGEST)
    (tmp_path / other).symlink_to(tmp_path / "other")
    assert not ensure_folder(tmp_path, other).is_symlink()

    # an empty folder this uid cannot write (the kubelet's, root-owned) is replaced; a full one is reported
    kubelets = naming.engines_entry("team-c", DIGEST)
    (tmp_path / kubelets).mkdir()
    inode = (tmp_path / kubelets).stat().st_ino
    real_access = os.access
    monkeypatch.setattr(engine_sync.os, "access", lambda p, mode: False if Path(p).name == kubelets
                        and (tmp_path / kubelets).stat().st_ino == inode else real_access(p, mode))
    assert ensure_folder(tmp_path, kubelets).stat().st_ino != inode
    (tmp_path / kubelets).rmdir()
    (tmp_path / kubelets).mkdir()
    inode = (tmp_path / kubelets).stat().st_ino
    (tmp_path / kubelets / "x").write_text("")
    with pytest.raises(OSError, match="not empty"):
        ensure_folder(tmp_path, kubelets)
    assert set(scan_engines(tmp_path)) == {name, other, kubelets}


def test_the_oldest_builds_go_first_past_the_bound(tmp_path: Path) -> None:
    for i, age in enumerate((300, 100, 200)):
        path = make_build(tmp_path, f"cpu-x86_64-avx2/g/b{i}", {"w": b"x" * 1000})
        old = time.time() - age
        os.utime(path, (old, old))
    assert prune(tmp_path, 2500) == ["cpu-x86_64-avx2/g/b0"]
    assert prune(tmp_path, 2500) == []
    assert prune(tmp_path, 0) == ["cpu-x86_64-avx2/g/b2", "cpu-x86_64-avx2/g/b1"]


def test_a_pass_without_peers_makes_folders_and_labels_what_is_held(tmp_path: Path) -> None:
    want = Want("team-a", DIGEST, "https://w")
    first = sync_engines(tmp_path, {want.engines: want}, {}, "cpu-x86_64-avx2", None)
    assert first.labels == [] and first.problems == [] and (tmp_path / want.engines).is_dir()
    make_build(tmp_path / want.engines, "cpu-x86_64-avx2/sha256-5e5e/int8-cpu-1")
    make_build(tmp_path / want.engines, "cuda-nvidia-l4/m-5e5e/trtllm-1")
    second = sync_engines(tmp_path, {want.engines: want}, {}, "cpu-x86_64-avx2", None)
    assert second.labels == [naming.engine_label_key(DIGEST, "team-a", "cpu-x86_64-avx2"),
                             naming.engine_label_key(DIGEST, "team-a", "cuda-nvidia-l4")]
