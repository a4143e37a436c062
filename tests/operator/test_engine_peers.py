"""Engine builds between two nodes' agents: `embedfleet cache serve-peers` as a real process on one cache root,
`engine_fetch` / `engine_sync` filling another. What is offered, what is refused, what arrives."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import httpx
import pytest
from peer_helpers import Peer, make_build

from embedfleet.operator.cache.engine_fetch import fetch_builds
from embedfleet.operator.cache.engine_sync import sync_engines
from embedfleet.operator.cache.engines import SOURCE_RECORD, Build, list_builds
from embedfleet.operator.cache.peer_fetch import PeerFailed
from embedfleet.operator.cache.wanted import Want
from embedfleet.operator.crd import naming

DIGEST = "sha256:" + "7c" * 32
CPU = "cpu-x86_64-avx512vnni"
GPU = "cuda-nvidia-h100-80gb-hbm3"
ENTRY = naming.engines_entry("team-a", DIGEST)
INT8 = f"{CPU}/sha256-7c7c7c7c7c7c7c7c/int8-cpu-0123456789abcdef"
PLAN = f"{GPU}/m-7c7c7c7c7c7c7c7c/trtllm-fedcba9876543210"


@pytest.fixture
def holder(tmp_path: Path) -> tuple[Peer, Path]:
    """A node whose runtimes built an int8 model and a TensorRT-LLM plan, serving its peers."""
    root = tmp_path / "root-a"
    folder = root / ENTRY
    make_build(folder, INT8, {"model.xml": b"<net/>", "model.bin": os.urandom(300_000), "int8.json": b'{"k": 1}'})
    make_build(folder, PLAN, {"rank0.engine": os.urandom(200_000), "config/build.json": b"{}"})
    peer = Peer(root)
    yield peer, folder
    peer.proc.terminate()
    peer.proc.wait(timeout=30)


def same_tree(a: Path, b: Path) -> bool:
    def tree(p: Path) -> dict[str, bytes]:
        return {f.relative_to(p).as_posix(): f.read_bytes() for f in p.rglob("*")
                if f.is_file() and f.name != SOURCE_RECORD}
    return tree(a) == tree(b)


def test_a_node_copies_the_builds_of_its_accelerator_and_only_those(holder, tmp_path: Path) -> None:
    peer, folder = holder
    mine = tmp_path / "root-b" / ENTRY
    mine.mkdir(parents=True)
    got = fetch_builds(peer.url, ENTRY, CPU, mine, set())
    assert [b.rel for b in got] == [INT8]
    assert same_tree(folder / INT8, mine / INT8)
    record = json.loads((mine / INT8 / SOURCE_RECORD).read_text())
    assert record["source"] == "peer" and record["from"] == peer.url and record["bytes"] > 300_000
    assert list_builds(mine) == [Build(*INT8.split("/"))]  # no GPU build on a CPU-only ask; no leftovers
    assert [p.name for p in (mine / INT8).parent.iterdir() if p.name.startswith(".")] == [
        f".{INT8.rsplit('/', 1)[1]}.lock"]
    # asked again: nothing is copied twice
    assert fetch_builds(peer.url, ENTRY, CPU, mine, set(list_builds(mine))) == []
    assert fetch_builds(peer.url, ENTRY, CPU, mine, set()) == []  # the folder is there: kept, not replaced
    got = fetch_builds(peer.url, ENTRY, GPU, mine, set())
    assert [b.rel for b in got] == [PLAN] and same_tree(folder / PLAN, mine / PLAN)


def test_a_build_a_runtime_is_making_here_is_left_to_it(holder, tmp_path: Path) -> None:
    peer, _ = holder
    mine = tmp_path / "root-b" / ENTRY
    group = mine / INT8.rsplit("/", 1)[0]
    group.mkdir(parents=True)
    with open(group / f".{INT8.rsplit('/', 1)[1]}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # what the runtime's build_lock holds while it quantises
        assert fetch_builds(peer.url, ENTRY, CPU, mine, set()) == []
    assert list_builds(mine) == []
    assert [b.rel for b in fetch_builds(peer.url, ENTRY, CPU, mine, set())] == [INT8]


def test_the_size_bound_holds_before_a_byte_is_fetched(holder, tmp_path: Path) -> None:
    peer, _ = holder
    mine = tmp_path / "root-b" / ENTRY
    mine.mkdir(parents=True)
    with pytest.raises(PeerFailed, match="more than the limit"):
        fetch_builds(peer.url, ENTRY, CPU, mine, set(), max_bytes=100_000)
    assert list_builds(mine) == [] and not any(mine.rglob("model.bin"))


def test_a_build_holding_a_symlink_is_never_offered_and_paths_stay_inside(holder, tmp_path: Path) -> None:
    peer, folder = holder
    (folder / PLAN / "secret").symlink_to("/etc/shadow")
    listing = httpx.get(f"{peer.url}/v1/engines/{ENTRY}/{GPU}/manifest").json()
    assert listing["builds"] == []
    assert "not offering" in peer.log.read_text()
    base = f"{peer.url}/v1/engines/{ENTRY}/{CPU}/files/{INT8.split('/', 1)[1]}"
    assert httpx.get(f"{base}/model.xml").status_code == 200
    for bad in (f"{base}/..%2F..%2F..%2Fint8.json", f"{base}/%2E%2E/x", f"{base}/.lock", f"{base}/nope",
                f"{peer.url}/v1/engines/{ENTRY}/..%2F{CPU}/manifest",
                f"{peer.url}/v1/engines/team-a_sha256-{'7c' * 32}/{CPU}/manifest",
                f"{peer.url}/v1/engines/{ENTRY}/not-an-accelerator/manifest",
                f"{peer.url}/v1/engines/{ENTRY}/{CPU}/files/.x/b/model.xml"):
        assert httpx.get(bad).status_code == 404, bad


def test_bytes_that_do_not_match_the_listing_leave_nothing_behind(holder, tmp_path: Path) -> None:
    peer, folder = holder
    mine = tmp_path / "root-b" / ENTRY
    mine.mkdir(parents=True)
    listing = httpx.get(f"{peer.url}/v1/engines/{ENTRY}/{CPU}/manifest").json()  # hashes now remembered
    assert listing["builds"][0]["name"] == INT8.rsplit("/", 1)[1]
    with open(folder / INT8 / "model.bin", "r+b") as fh:  # rot in place: same size, same mtime
        st = os.fstat(fh.fileno())
        fh.write(b"\0" * 16)
    os.utime(folder / INT8 / "model.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(PeerFailed, match="sha256"):
        fetch_builds(peer.url, ENTRY, CPU, mine, set())
    assert list_builds(mine) == []
    assert [p for p in mine.rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []


def test_a_pass_asks_peers_for_what_its_node_lacks_and_labels_it(holder, tmp_path: Path) -> None:
    peer, _ = holder
    root = tmp_path / "root-b"
    root.mkdir()
    want = Want("team-a", DIGEST, "https://w")
    asked: list[str] = []

    def find(label: str, digest: str) -> list[str]:
        asked.append(label)
        return ["http://127.0.0.1:9", peer.url]  # the first one is down: the next one serves

    labels = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    out = sync_engines(root, {want.engines: want}, labels, CPU, find, timeout_s=5)
    assert sorted(out.fetched) == sorted([f"{ENTRY}/{INT8}", f"{ENTRY}/{PLAN}"])
    assert asked == [naming.engine_label_key(DIGEST, "team-a", CPU), naming.engine_label_key(DIGEST, "team-a", GPU)]
    assert out.labels == asked and out.problems == []
    asked.clear()  # a node that holds builds of each of its accelerators asks nobody
    assert sync_engines(root, {want.engines: want}, labels, CPU, find, timeout_s=5).fetched == [] and asked == []
    # a CPU-only node asks for its CPU class alone
    other = tmp_path / "root-c"
    other.mkdir()
    asked.clear()
    out = sync_engines(other, {want.engines: want}, {}, CPU, find, timeout_s=5)
    assert asked == [naming.engine_label_key(DIGEST, "team-a", CPU)] and out.fetched == [f"{ENTRY}/{INT8}"]
