"""A replica's cold start with an int8 engine: built on the node, or copied from a peer node's agent.

Two node folders on this machine stand for two nodes' engines folders of one tenant's model
(`<root>/<namespace>_engines-sha256-<hex>`, the layout the operator mounts). In one run:

  build   `embedfleet serve --dtype int8 --engine-cache-dir <node A>` on the embedded all-MiniLM-L6-v2,
          the folder empty: the runtime converts, quantises and judges the model, then serves
  fetch   node B's agent copies what node A holds for this machine's CPU class from node A's peer server
          (`embedfleet cache serve-peers`, a real process; `engine_sync.sync_engines`, the agent's own pass):
          seconds and MB/s
  peer    `embedfleet serve --dtype int8 --engine-cache-dir <node B>`: the runtime finds the copied build,
          checks its key and loads it
  node    node A again: the build made there (a replica restarting, or the second replica on the node)

Each start is process start to /ready (the runtime's own `ready` phase, from /load). The figure is the
ratio peer start (with its fetch) / build start, baseline measured in the same run. One JSON line, also
appended to bench/results/engine-peer-cpu.jsonl.

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1 .venv/bin/python bench/engine_peer.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / p) for p in ("runtime", "operator", "client")]
from _common import SOURCE_PATHS, Server, add_results_dir, free_port, record  # noqa: E402
from embedfleet.operator.cache.engine_sync import sync_engines  # noqa: E402
from embedfleet.operator.cache.engines import cpu_accelerator, list_builds  # noqa: E402
from embedfleet.operator.cache.wanted import Want  # noqa: E402
from embedfleet.operator.crd import naming  # noqa: E402

DIGEST = "sha256:" + "ab" * 32  # names the folders only: the embedded model is served in place
TENANT = "team-bench"


def start(folder: Path, log: Path) -> tuple[float, dict]:
    """Start a runtime on ``folder``; (seconds to /ready as the runtime counts them, its startup report)."""
    started = time.monotonic()
    server = Server("--dtype", "int8", "--engine-cache-dir", str(folder), log_file=log)
    wall = time.monotonic() - started
    try:
        report = httpx.get(server.url + "/load", timeout=10).json().get("startup") or {}
        card = server.card()
    finally:
        server.stop()
    phases = report.get("phases") or {}
    ready = phases.get("ready")
    return (float(ready) if isinstance(ready, int | float) else wall), {"report": report, "dtype": card.get("dtype")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_dir(parser, "engine-peer-cpu.jsonl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        entry = naming.engines_entry(TENANT, DIGEST)
        node_a, node_b = base / "node-a", base / "node-b"
        (node_a / entry).mkdir(parents=True)
        node_b.mkdir()
        build_s, build_info = start(node_a / entry, base / "build.log")
        builds = list_builds(node_a / entry)
        size = sum(f.stat().st_size for b in builds for f in (node_a / entry / b.rel).rglob("*") if f.is_file())

        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS))
        with open(base / "peer.log", "w") as out:
            peer = subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", "cache", "serve-peers",
                                     "--cache-root", str(node_a), "--host", "127.0.0.1", "--port", str(port)],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(200):
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            want = Want(TENANT, DIGEST, "https://origin.invalid/m")
            t0 = time.monotonic()
            outcome = sync_engines(node_b, {entry: want}, {}, cpu_accelerator(), lambda _label, _d: [url])
            fetch_s = time.monotonic() - t0
        finally:
            peer.terminate()
            peer.wait(30)
        peer_s, peer_info = start(node_b / entry, base / "peer-start.log")
        node_s, node_info = start(node_a / entry, base / "node.log")

    def source(info: dict) -> str | None:
        models = info["report"].get("models") or {}
        return next((m["engine"]["source"] for m in models.values() if (m or {}).get("engine")), None)

    row = {
        "bench": "engine_peer",
        "machine": platform.machine(), "cpus": os.cpu_count(), "accelerator": cpu_accelerator(),
        "model": "all-MiniLM-L6-v2 (embedded), --dtype int8",
        "build_bytes": size, "builds": [b.rel for b in builds],
        "start_build_s": round(build_s, 2), "engine_source_build": source(build_info),
        "fetch_s": round(fetch_s, 3), "fetch_mb_per_s": round(size / fetch_s / 1e6, 1) if fetch_s else None,
        "fetched": outcome.fetched,
        "start_peer_s": round(peer_s, 2), "engine_source_peer": source(peer_info),
        "start_node_s": round(node_s, 2), "engine_source_node": source(node_info),
        "peer_with_fetch_over_build": round((peer_s + fetch_s) / build_s, 3),
        "node_over_build": round(node_s / build_s, 3),
        "served_dtype": [build_info["dtype"], peer_info["dtype"], node_info["dtype"]],
    }
    print(json.dumps(row))
    record("engine-peer", row, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
