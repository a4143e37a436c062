"""A spot node reclaimed under load, on two real nodes (scripts/realnode.sh up + join): the operator's hand-over
against a plain drain, in one run.

Root only; builds nothing (run `bash scripts/setup.sh --test` as root first). realnode-2 carries the spot label
(`embedfleet.dev/capacity-class=spot`); examples/embedding.yaml at two replicas with `spot.max: 1` runs one
replica on each node. Three clients send embeddings through the gateway pod the whole time. Scenarios:

  drain    baseline: `kubectl drain realnode-2` evicts the spot replica at once (as a node's termination
           handler that drains does); the operator raises the on-demand stand-in once it sees the spot pod
           cannot run
  reclaim  the node gets the `embedfleet.dev/reclaim=true:NoSchedule` taint (as the clouds' termination
           handlers do); the operator raises the stand-in on realnode-1 first and evicts the spot replica through
           the eviction API once it is Ready

Figures per scenario, seconds from the drain or the taint, pods polled every 0.25 s:
  stand_in_ready_s     two Ready replicas on realnode-1
  spot_pod_gone_s      the spot replica deleted (terminating) or gone
  capacity_gap_s       total time with fewer than two Ready replicas (terminating ones not counted)
  requests, requests_failed   answered through the gateway during the scenario; failed = anything but 200/429

One JSON line, also appended to bench/results/realnode-spot-cpu.jsonl.

    sudo .venv/bin/python bench/realnode_spot.py
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), *(str(ROOT / p) for p in ("runtime", "operator", "client"))]

import yaml  # noqa: E402
from tests.kube.controlplane import wait_until  # noqa: E402
from tests.realnode.node import GATEWAY_PORT, SECOND_NODE, Load, RealNode, is_ready, realnode_home  # noqa: E402
from tests.realnode.test_user_path import all_runtimes, example, gateway_ip  # noqa: E402

from _common import add_results_dir, record  # noqa: E402
from realnode_coldstart import installed_node  # noqa: E402

FIRST_NODE = "realnode-1"
NAME = "minilm-spot"
SPOT_LABEL = "embedfleet.dev/capacity-class=spot"


class Sampler:
    """Polls the deployment's pods: (seconds since start, Ready pods, Ready pods on realnode-1, spot pod there)."""

    def __init__(self, node: RealNode, spot_pod: str) -> None:
        self.node, self.spot_pod = node, spot_pod
        self.samples: list[tuple[float, int, int, bool]] = []
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pods = all_runtimes(self.node, NAME)
            ready = [p for p in pods if is_ready(p)]
            spot = any(p["metadata"]["name"] == self.spot_pod and not p["metadata"].get("deletionTimestamp")
                       for p in pods)
            self.samples.append((time.time() - self.t0, len(ready),
                                 sum(p["spec"].get("nodeName") == FIRST_NODE for p in ready), spot))
            self._stop.wait(0.25)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(10)
        first = lambda test: next((round(t, 2) for t, *rest in self.samples if test(*rest)), None)  # noqa: E731
        gap = sum(b[0] - a[0] for a, b in zip(self.samples, self.samples[1:], strict=False) if a[1] < 2)
        return {"stand_in_ready_s": first(lambda ready, on_first, spot: on_first >= 2),
                "spot_pod_gone_s": first(lambda ready, on_first, spot: not spot),
                "capacity_gap_s": round(gap, 2)}


def scenario(node: RealNode, how: str) -> dict[str, Any]:
    doc = example()
    doc["metadata"]["name"] = NAME
    doc["spec"]["autoscaling"].update(minReplicas=2, maxReplicas=2)
    doc["spec"]["spot"] = {"max": 1, "fallback": "onDemand", "returnAfterSeconds": 600}
    node.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    pods = wait_until(lambda: (r := [p for p in all_runtimes(node, NAME) if is_ready(p)]) and len(r) == 2 and r,
                      600, "two Ready replicas")
    spot_pod = next(p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == SECOND_NODE)
    try:
        with Load(gateway_ip(node), GATEWAY_PORT) as load:
            wait_until(lambda: load.ok >= 20, 120, "the load answered through the gateway")
            before = dict(load.outcomes)
            sampler = Sampler(node, spot_pod)
            if how == "drain":
                node.kubectl("drain", SECOND_NODE, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s",
                             timeout=400)
            else:
                node.kubectl("taint", "node", SECOND_NODE, "embedfleet.dev/reclaim=true:NoSchedule")
            wait_until(lambda: (s := sampler.samples) and s[-1][2] >= 2 and not s[-1][3], 600,
                       "two Ready replicas on realnode-1 and the spot replica gone")
            served = load.ok
            wait_until(lambda: load.ok > served + 20, 120, "the load answered after the hand-over")
            figures = sampler.stop()
        outcomes = {k: v - before.get(k, 0) for k, v in load.outcomes.items()}
        return {**figures, "requests": sum(outcomes.values()),
                "requests_failed": sum(v for k, v in outcomes.items() if k not in ("200", "429")),
                "shed_429": outcomes.get("429", 0)}
    finally:
        node.kubectl("delete", "embeddingdeployment", NAME, "--ignore-not-found", "--wait=true", timeout=300)
        wait_until(lambda: not all_runtimes(node, NAME), 300, f"{NAME}'s pods gone")
        node.kubectl("uncordon", SECOND_NODE, check=False)
        node.kubectl("taint", "node", SECOND_NODE, "embedfleet.dev/reclaim-", check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_dir(parser, "realnode-spot-cpu.jsonl")
    args = parser.parse_args()
    with installed_node("realnode-spot-", realnode_home() / "nodecache") as (node, _work):
        node.join()
        node.kubectl("label", "node", SECOND_NODE, SPOT_LABEL, "--overwrite")
        rows = {how: scenario(node, how) for how in ("drain", "reclaim")}
    result = {"bench": "realnode_spot", "replicas": 2, "spot": 1, "baseline": "drain (same run)", "rows": rows}
    print(json.dumps(result))
    record("realnode-spot", result, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
