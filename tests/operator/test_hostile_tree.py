"""A tenant's engines folder is hostile input: its runtime pods can write anything there, links, FIFOs and
dangling links included, on every node. Two nodes' cache roots under one tmp "universe" (with an /etc-like
folder beside them): the tenant plants on both, `embedfleet cache serve-peers` serves node A as a real
process, and node B's agent pass (`engine_sync.sync_engines`, in its own process) copies from it. Every
byte of the universe outside the tenant's own folder on B is hashed before and after: nothing may change,
appear or vanish there, and nothing of another tenant may be offered."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from peer_helpers import Peer, make_build
from tests.procs import child_env

from embedfleet.operator.crd import naming

DIGEST = "sha256:" + "7c" * 32
CPU = "cpu-x86_64-avx512vnni"
GPU = "cuda-nvidia-h100-80gb-hbm3"
ATTACKER = naming.engines_entry("team-a", DIGEST)
VICTIM = naming.engines_entry("team-b", DIGEST)
VICTIM_WEIGHTS = naming.cache_entry("team-b", DIGEST)
FORGED = b'{"min_cosine": 1.0}'

PASS = """
import json, sys
from pathlib import Path
from embedfleet.operator.cache.engine_sync import sync_engines
from embedfleet.operator.cache.wanted import Want
root, url, cpu = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
want = Want("team-a", sys.argv[4], "https://w")
out = sync_engines(root, {want.engines: want}, {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, cpu,
                   lambda label, digest: [url], timeout_s=10, max_bytes=10_000_000)
print(json.dumps({"fetched": out.fetched, "problems": out.problems}))
"""


def snapshot(top: Path, skip: list[Path]) -> dict[str, str]:
    """Every entry under ``top`` (not following links): a file's sha256, a link's target, a FIFO's kind."""
    out: dict[str, str] = {}
    for folder, dirs, files in os.walk(top, followlinks=False):
        base = Path(folder)
        if any(base == s or s in base.parents for s in skip):
            continue
        for name in dirs + files:
            path = base / name
            if any(path == s or s in path.parents for s in skip) or path.suffix == ".log":
                continue
            st = os.lstat(path)
            rel = path.relative_to(top).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link->" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            else:
                out[rel] = f"mode {stat.S_IFMT(st.st_mode):o}"
    return out


def test_links_planted_by_a_tenant_change_nothing_outside_its_folder(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    a, b = tmp_path / "root-a", tmp_path / "root-b"
    for root in (a, b):  # another tenant's weights and builds on both nodes
        weights = root / VICTIM_WEIGHTS
        weights.mkdir(parents=True)
        (weights / "model.safetensors").write_bytes(os.urandom(4096))
        make_build(root / VICTIM, f"{CPU}/g1/victim", {"int8.json": b'{"min_cosine": 0.91}', "model.bin": b"v" * 99})
        (root / VICTIM / GPU).mkdir()

    # node A: the tenant's complete builds, and builds that point at other tenants' files
    mine_a = a / ATTACKER
    for group in ("g0", "g1", "g2", "g3", "g4", "g5", "g6"):
        make_build(mine_a, f"{CPU}/{group}/b{group[1]}", {"int8.json": FORGED, "model.bin": os.urandom(2048)})
    make_build(mine_a, f"{GPU}/m/plan", {"rank0.engine": os.urandom(1024)})
    leak = make_build(mine_a, f"{CPU}/g7/leak", {"model.bin": b"x"})
    (leak / "int8.json").symlink_to(a / VICTIM / CPU / "g1" / "victim" / "int8.json")
    (leak / "weights").symlink_to(a / VICTIM_WEIGHTS)
    pipe = make_build(mine_a, f"{CPU}/g8/pipe", {"model.bin": b"x"})
    os.mkfifo(pipe / "int8.json")
    (mine_a / CPU / "g9").symlink_to(a / VICTIM / CPU / "g1")  # another tenant's group as one's own

    # node B: the same tenant's folder, planted where the agent creates folders, locks and builds
    mine_b = b / ATTACKER
    (mine_b / CPU).mkdir(parents=True)
    (mine_b / CPU / "g1").symlink_to(b / VICTIM / CPU / "g1")  # the group: into the victim's folder
    (mine_b / CPU / "g2").mkdir()
    (mine_b / CPU / "g2" / ".b2.lock").symlink_to(b / VICTIM_WEIGHTS / "model.safetensors")  # truncated today
    (mine_b / CPU / "g3").mkdir()
    os.mkfifo(mine_b / CPU / "g3" / ".b3.lock")  # opening it for writing blocks today
    (mine_b / CPU / "g4").mkdir()
    (mine_b / CPU / "g4" / ".b4.lock").symlink_to(etc / "made-by-the-agent")  # dangling: O_CREAT makes it
    (mine_b / CPU / "g5").mkdir()
    (mine_b / CPU / "g5" / "b5").symlink_to(b / VICTIM / CPU / "g1" / "victim")  # the build's own name
    (mine_b / CPU / "g6").symlink_to(etc)  # the group: into /etc
    (mine_b / GPU).symlink_to(b / VICTIM / GPU)  # the accelerator: into the victim's folder

    before = snapshot(tmp_path, skip=[mine_b])
    peer = Peer(a)
    try:
        listing = httpx.get(f"{peer.url}/v1/engines/{ATTACKER}/{CPU}/manifest", timeout=30).json()
        offered = {(item["group"], item["name"]) for item in listing["builds"]}
        assert offered == {(f"g{i}", f"b{i}") for i in range(7)}  # never the leak, the pipe, nor g9
        files = f"{peer.url}/v1/engines/{ATTACKER}/{CPU}/files"
        for rel in ("g7/leak/int8.json", "g7/leak/weights/model.safetensors", "g8/pipe/int8.json",
                    "g9/victim/int8.json"):
            assert httpx.get(f"{files}/{rel}", timeout=30).status_code == 404, rel

        done = subprocess.run([sys.executable, "-c", PASS, str(b), peer.url, CPU, DIGEST], env=child_env(),
                              capture_output=True, text=True, timeout=120)
    finally:
        peer.proc.terminate()
        peer.proc.wait(timeout=30)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

    after = snapshot(tmp_path, skip=[mine_b])
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert changed == [], changed
    # what the tenant could rightly get still arrives, into its own folder only
    assert f"{ATTACKER}/{CPU}/g0/b0" in out["fetched"]
    assert (mine_b / CPU / "g0" / "b0" / "int8.json").read_bytes() == FORGED
    assert not (b / VICTIM / CPU / "g1" / "b1").exists() and not (etc / "b6").exists()
    assert [p.name for p in b.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_tree_nested_past_the_bound_is_not_offered(tmp_path: Path) -> None:
    from embedfleet.operator.cache.engines import BuildUnavailable, build_files
    from embedfleet.operator.cache.safefs import MAX_DEPTH

    build = make_build(tmp_path, "b", {"model.bin": b"x"})
    deep = build / "/".join(["d"] * (MAX_DEPTH + 2))
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(b"y")
    with pytest.raises(BuildUnavailable, match="folders deep"):
        build_files(build)
