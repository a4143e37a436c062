"""Cold starts on the second of two real nodes (scripts/realnode.sh up + join): weights from the origin against
weights from the first node's agent, in one run.

Root only; builds nothing (run `bash scripts/setup.sh --test` as root first). Two real nodes on this machine
(each its own kubelet, containerd, pod range and node cache folder) and the chart with
`nodeAgent.peers.enabled`; an http origin on the bridge serves all-MiniLM-L6-v2. Rows, each from `kubectl
apply` to the first answer of a replica placed on realnode-2 (`spec.runtime.nodeSelector`), split by the
pod's own timestamps (bench/realnode_coldstart.py):

  origin   no pre-pull, realnode-2's cache empty: the runtime pod's init container downloads from the origin
  peer     a deployment pinned to realnode-1 holds the weights there (pre-pull); the measured one pre-pulls
           on realnode-2 only and requires a cached node: realnode-2's agent fetches from realnode-1's agent
           (never the origin; its `.source.json` is kept in the row), then the pod links the entry

Each row also counts the origin's requests during it. Ratio against the same run: peer / origin. One JSON
line, also appended to bench/results/realnode-two-nodes-cpu.jsonl.

    sudo .venv/bin/python bench/realnode_two_nodes.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), *(str(ROOT / p) for p in ("runtime", "operator", "client"))]

from tests.kube.controlplane import wait_until  # noqa: E402
from tests.realnode.node import SECOND_NODE, ModelServer, RealNode, realnode_home  # noqa: E402
from tests.realnode.test_user_path import all_runtimes, http_deployment  # noqa: E402

from _common import add_results_dir, record  # noqa: E402
from embedfleet.operator.crd import naming  # noqa: E402
from realnode_coldstart import cold_start, installed_node  # noqa: E402

FIRST_NODE = "realnode-1"
HOSTNAME = "kubernetes.io/hostname"


def pinned(doc: dict[str, Any], name: str, node: str, pre_pull: bool, require_cached: bool = False) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    doc["metadata"]["name"] = name
    doc["spec"]["runtime"] = {**doc["spec"].get("runtime", {}), "nodeSelector": {HOSTNAME: node}}
    doc["spec"]["cache"] = {"prePull": pre_pull, "nodeSelector": {HOSTNAME: node},
                            **({"requireCachedNode": True} if require_cached else {})}
    return doc


def placed(node: RealNode, name: str) -> list[str]:
    return sorted(p["spec"].get("nodeName", "") for p in all_runtimes(node, name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_dir(parser, "realnode-two-nodes-cpu.jsonl")
    args = parser.parse_args()
    cache = realnode_home() / "nodecache"
    with installed_node("realnode-two-", cache, "--set", "nodeAgent.peers.enabled=true", "--set",
                        "nodeAgent.intervalSeconds=5") as (node, work):
        node.join()
        served = ModelServer(work)
        try:
            http = http_deployment("minilm-http", served.url, served.digest)
            label = naming.cache_label_key(served.digest, "default")
            rows: dict[str, Any] = {}

            before = len(served.requests)
            rows["origin"] = cold_start(node, pinned(http, "minilm-origin", SECOND_NODE, pre_pull=False))
            rows["origin"]["node"] = placed(node, "minilm-origin")
            rows["origin"]["origin_requests"] = len(served.requests) - before
            node.kubectl("delete", "embeddingdeployment", "minilm-origin", "--wait=true", timeout=300)

            node.kubectl("apply", "-f", "-", input=json.dumps(pinned(http, "minilm-keeper", FIRST_NODE, True)))
            wait_until(lambda: node.get("node", FIRST_NODE)["metadata"]["labels"].get(label) == "ready", 600,
                       f"the cache label on {FIRST_NODE}")
            assert node.get("node", SECOND_NODE)["metadata"]["labels"].get(label) is None, "realnode-2 cached early"
            before = len(served.requests)
            rows["peer"] = cold_start(node, pinned(http, "minilm-peer", SECOND_NODE, True, require_cached=True))
            rows["peer"]["node"] = placed(node, "minilm-peer")
            rows["peer"]["origin_requests"] = len(served.requests) - before
            entry = node.node_cache(SECOND_NODE) / naming.cache_entry("default", served.digest)
            rows["peer"]["weights_record"] = json.loads((entry / ".source.json").read_text())
            if rows["peer"]["weights_record"]["source"] != "peer" or rows["peer"]["origin_requests"]:
                raise SystemExit(f"the peer row did not come from the peer alone: {rows['peer']}")
            result = {"bench": "realnode_two_nodes", "rows": rows,
                      "peer_over_origin": round(rows["peer"]["apply_to_first_answer_s"]
                                                / rows["origin"]["apply_to_first_answer_s"], 3)}
            print(json.dumps(result))
            record("realnode-two-nodes", result, results_dir=args.results_dir)
        finally:
            served.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
