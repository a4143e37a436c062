"""The hub loop on a real fleet: one hub API server and N spoke API servers, thousands of
EmbeddingDeployments placed, then idle rounds, then a 5% change. One JSON line.

A fresh control plane (tests/kube: one etcd, a kube-apiserver per cluster with RBAC and an audit log; no
controllers, no nodes: nothing has to run the spokes' copies, the hub only writes them). The CRDs are
installed on every cluster. On each spoke a thread of this bench renews the heartbeat Lease
``embedfleet-system/embedfleet-spoke`` every 2 s, as a spoke operator does (leaseDurationSeconds 10; the
FleetCluster's lease is 10 s + 10 s grace). On the hub: one FleetCluster per spoke (regions spread over 4,
large CPU capacity) whose kubeconfig Secret holds that spoke's *admin* kubeconfig (a bench shortcut: a
real hub gets the chart's ``hubAccess`` identity, which does not change what the hub calls), and
``--deployments`` EmbeddingDeployments over 20 namespaces (autoscaling off, replicas 1-4; ActiveActive
minRegions 1 or 2, or RegionLocked to one region). Then the hub's controller runs in this process
(``reconcile_all()`` called here, back to back: every cluster, placement, every policy; a "round" below is
one such call) and the audit logs of all clusters say what it did.

Attribution: the hub's requests carry User-Agent ``embedfleet-operator/<identity>``; this bench's own
requests (object creation, Lease renewals, the 5% patch) carry ``embedfleet-bench``, and kubectl its own,
so every figure below counts only the hub's requests. A watch is counted once when it opens (audit stage
ResponseStarted), never as a call per round.

Figures:
  first_round_s, first_round_writes   the round that places everything (its writes: those made from its
                                      start to the next round's, on the hub and every spoke)
  place_rounds / place_s / place_writes   rounds until one writes nothing (converged), wall time, writes by
                                      cluster:verb:resource
  copies / copies_expected            hub-managed copies on the spokes vs the shares the hub placed
  steady_round_s_median / _max        --rounds idle rounds after convergence
  steady_calls_per_round              the hub's non-watch requests per idle round, all clusters (and by kind)
  steady_writes_per_round             goal 0
  watch_opens_*                       watches the hub opened: its 4 + 2 per spoke informers, each opened again
                                      whenever the server ends it (60 s), so a window's count depends on timing
  change_*                            5% of the deployments get another ``replicas``: rounds until converged
                                      again, their writes, writes per changed deployment (O(changed))
  old_design_*                        the loop as it was at commit a4181f8 (one list per collection per round,
                                      a Lease GET and a kubeconfig Secret GET per spoke, a Namespace GET per
                                      namespace) run on the same fleet for --rounds rounds after one warm-up
                                      round: measured; ``old_design_reads_per_round_computed`` is the formula
                                      2*spokes + 3 + namespaces (it leaves out the per-spoke Secret GET)

Run: cd bench && python hub_fleet.py --spokes 10 --deployments 2000 (needs the control plane built:
scripts/kube-tools.sh). Rows appended to bench/results/hub-fleet-cpu.jsonl.

This machine (2 cores, 24 GB), --spokes 16 --deployments 2000 (17 API servers on one etcd; 257 s in all):
  placing: 2 rounds, 80.3 s (first round 76.4 s: 16 links set up, 2000 status patches in sequence), 7619
    writes = 5283 copies + 320 namespaces on the spokes, 16 FleetCluster and 2000 deployment status
    patches (one per deployment); 5283 copies for 5283 shares; the second round wrote nothing
  idle: 0 calls and 0 writes in each of 5 rounds, median 1.6 s / max 4.0 s (all in-process planning)
  5% change (100 deployments): 2 rounds, 5.8 s, 355 writes = 3.55 per changed deployment (66 creates +
    89 deletes of copies, 100 status patches, 100 Rescheduled Events), all 100 in place on the spokes
  old loop (a4181f8) on the same fleet: 71 reads per idle round (3*spokes + 3 + namespaces), 3.6 s each
  (an earlier run, before status rows dropped the scheduler's score, counted 2 status patches per
  deployment: the score moved from "score 70" to "score 80" once the share was sticky)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform as pyplatform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "operator")]

from tests.kube.controlplane import KUBE_VERSION, Cluster, ControlPlane, missing_reason  # noqa: E402

from _common import add_results_dir, record  # noqa: E402
from embedfleet.operator import platform  # noqa: E402
from embedfleet.operator.hub.controller import HubController  # noqa: E402
from embedfleet.operator.kube import Kube, load_client  # noqa: E402
from embedfleet.operator.spoke.heartbeat import LEASE_NAME, lease_body, policy_json  # noqa: E402

SYSTEM = "embedfleet-system"
API = "embedfleet.dev/v1alpha1"
DIGEST = "sha256:" + "ab" * 32
REGIONS = [f"region-{i}" for i in range(4)]
NAMESPACES = [f"team-{i:02d}" for i in range(20)]
BENCH_UA = "embedfleet-bench"
HUB_UA = "embedfleet-operator/"
OLD_UA = "embedfleet-old-hub"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
OLD_COMMIT = "a4181f8"
RENEW_S = 2.0
LEASE = {"durationSeconds": 10, "graceSeconds": 10}


# ---------------------------------------------------------------- the fleet


def bench_kube(cluster: Cluster) -> Kube:
    client = load_client(cluster.kubeconfig)
    client.user_agent = BENCH_UA  # not the hub's: the audit log tells them apart
    return Kube(client)


def embedding(name: str, namespace: str, rng: random.Random) -> dict[str, Any]:
    """A small CPU EmbeddingDeployment (tests/hub/fleet.py's shape), fixed replicas, a placement intent."""
    kind = rng.random()
    if kind < 0.5:
        replicas, placement = rng.randint(1, 4), {"mode": "ActiveActive", "minRegions": 1}
    elif kind < 0.8:
        replicas, placement = rng.randint(2, 4), {"mode": "ActiveActive", "minRegions": 2}
    else:
        replicas, placement = rng.randint(1, 4), {"mode": "RegionLocked", "regions": [rng.choice(REGIONS)]}
    return {"apiVersion": API, "kind": "EmbeddingDeployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"source": "hf://sentence-transformers/all-MiniLM-L6-v2", "digest": DIGEST},
                     "runtime": {"image": "ghcr.io/embedfleet/runtime:0.1.0",
                                 "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
                     "autoscaling": {"enabled": False}, "replicas": replicas, "placement": placement}}


def install_crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "crds"), timeout=120)
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=120s", timeout=130)


class Heartbeats:
    """Each spoke's Lease renewed every RENEW_S from one thread, as a spoke operator renews it."""

    def __init__(self, spokes: dict[str, Cluster]) -> None:
        self.kubes = {name: bench_kube(c) for name, c in spokes.items()}
        self.policy = policy_json(platform.load())
        self.stop = threading.Event()
        self.failures = 0
        self.thread = threading.Thread(target=self._run, name="bench-heartbeats", daemon=True)

    def _body(self, name: str) -> dict[str, Any]:
        region = REGIONS[int(name.rsplit("-", 1)[1]) % len(REGIONS)]
        return lease_body(SYSTEM, f"bench-{name}", int(LEASE["durationSeconds"]), [], region, None, self.policy)

    def start(self) -> Heartbeats:
        for name, kube in self.kubes.items():
            body = self._body(name)
            body["metadata"]["annotations"] = {k: v for k, v in body["metadata"]["annotations"].items()
                                               if v is not None}
            kube.create(body)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(RENEW_S):
            for name, kube in self.kubes.items():
                body = self._body(name)
                try:
                    kube.patch_merge("Lease", LEASE_NAME, SYSTEM, {"metadata": body["metadata"], "spec": body["spec"]})
                except Exception:  # counted; the hub's grace period tolerates a missed beat
                    self.failures += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


# ---------------------------------------------------------------- the audit logs


class AuditTail:
    """All clusters' audit logs read in contiguous windows (each event in exactly one window)."""

    def __init__(self, clusters: Iterable[Cluster], hub: str) -> None:
        self.clusters = list(clusters)
        self.hub = hub
        self.offsets = {c.name: (c.audit_path.stat().st_size if c.audit_path.exists() else 0) for c in self.clusters}

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for cluster in self.clusters:
            if not cluster.audit_path.exists():
                continue
            with open(cluster.audit_path, "rb") as fh:
                fh.seek(self.offsets[cluster.name])
                data = fh.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next window
            self.offsets[cluster.name] += len(complete)
            where = "hub" if cluster.name == self.hub else "spoke"
            for line in complete.splitlines():
                try:
                    out.append((where, json.loads(line)))
                except ValueError:
                    continue
        return out


def _resource(raw: dict[str, Any]) -> str:
    ref = raw.get("objectRef") or {}
    return ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")


def account(events: list[tuple[str, dict[str, Any]]], agent: str) -> dict[str, Any]:
    """The requests of one user agent: calls (watches left out), writes, watch opens, errors; by kind."""
    calls: Counter[str] = Counter()
    writes: Counter[str] = Counter()
    watch_opens: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for where, raw in events:
        if not str(raw.get("userAgent") or "").startswith(agent):
            continue
        verb = raw.get("verb", "")
        key = f"{where}:{verb}:{_resource(raw)}"
        if verb == "watch":
            if raw.get("stage") == "ResponseStarted":
                watch_opens[key] += 1
            continue
        if raw.get("stage") != "ResponseComplete":
            continue
        calls[key] += 1
        code = int((raw.get("responseStatus") or {}).get("code") or 0)
        if verb in WRITE_VERBS and "dryRun=" not in raw.get("requestURI", ""):
            writes[key] += 1
        if code >= 400:
            errors[f"{key}:{code}"] += 1
    return {"calls": sum(calls.values()), "writes": sum(writes.values()), "watch_opens": sum(watch_opens.values()),
            "calls_by": dict(calls), "writes_by": dict(writes), "watch_opens_by": dict(watch_opens),
            "errors_by": dict(errors)}


def merge(accounts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"calls": 0, "writes": 0, "watch_opens": 0}
    for key in ("calls_by", "writes_by", "watch_opens_by", "errors_by"):
        total: Counter[str] = Counter()
        for a in accounts:
            total.update(a[key])
        out[key] = dict(sorted(total.items()))
    for key in ("calls", "writes", "watch_opens"):
        out[key] = sum(a[key] for a in accounts)
    return out


# ---------------------------------------------------------------- rounds


def idle(loop: HubController) -> bool:
    """No spoke's writes still running, and every spoke's watch shows the hub's last writes."""
    return all(not link.busy() and link.copies.caught_up(link.written) for link in loop.state.links.values())


def one_round(loop: HubController, audit: AuditTail, gap: float) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    loop.reconcile_all()
    seconds = time.perf_counter() - started
    time.sleep(gap)  # the audit log is written as requests complete
    return seconds, account(audit.take(), HUB_UA)


def until_converged(loop: HubController, audit: AuditTail, limit_s: float, gap: float = 0.3) -> dict[str, Any]:
    """Rounds until one writes nothing with no spoke's writes pending; its figures."""
    rounds: list[tuple[float, dict[str, Any]]] = []
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        rounds.append(one_round(loop, audit, gap))
        if rounds[-1][1]["writes"] == 0 and idle(loop):
            break
    converged = rounds[-1][1]["writes"] == 0 and idle(loop)
    total = merge([a for _, a in rounds])
    return {"converged": converged, "rounds": len(rounds), "seconds": round(time.monotonic() - started, 2),
            "round_s": [round(s, 3) for s, _ in rounds], "writes_per_round": [a["writes"] for _, a in rounds],
            "first_round_s": round(rounds[0][0], 3), "first_round_writes": rounds[0][1]["writes"],
            "total": total}


def hub_items(loop: HubController) -> dict[str, dict[str, Any]]:
    return loop.informers["deployments"].items()


def spoke_replicas(loop: HubController) -> dict[str, int]:
    """namespace/name -> replicas of all its copies together, as the hub's watches show them."""
    out: Counter[str] = Counter()
    for link in loop.state.links.values():
        for key, obj in link.copies.items().items():
            out[key] += int((obj.get("spec") or {}).get("replicas") or 0)
    return dict(out)


def placed(obj: dict[str, Any]) -> bool:
    return any(c.get("type") == "Placed" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


# ---------------------------------------------------------------- the loop as it was

OLD_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import kubernetes
_init = kubernetes.client.ApiClient.__init__
def _tagged(self, *a, **k):
    _init(self, *a, **k)
    self.user_agent = "__UA__"
kubernetes.client.ApiClient.__init__ = _tagged
from embedfleet.operator.hub.loop import HubLoop
from embedfleet.operator.kube import Kube, load_client
import embedfleet.operator.hub.loop as module
print(json.dumps({"file": module.__file__}), flush=True)
loop = HubLoop(Kube(load_client(sys.argv[2])), interval=1, ramp=0)
for line in sys.stdin:
    started = time.perf_counter()
    loop.run_round()
    print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
""".replace("__UA__", OLD_UA)


def old_design(hub: Cluster, audit: AuditTail, rounds: int, workdir: Path) -> dict[str, Any]:
    """The loop at OLD_COMMIT, in a child process on the same fleet: one warm-up round, then `rounds`."""
    tree = workdir / "old"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_COMMIT, "operator/embedfleet"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    child = subprocess.Popen([sys.executable, "-c", OLD_CHILD, str(tree / "operator"), str(hub.kubeconfig)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(workdir))
    assert child.stdin is not None and child.stdout is not None
    results: list[tuple[float, dict[str, Any]]] = []
    try:
        loaded = json.loads(child.stdout.readline() or "{}").get("file", "")
        if not loaded.startswith(str(tree)):
            raise RuntimeError(f"the old loop was not loaded from {tree}: {loaded}")
        for _ in range(rounds + 1):
            child.stdin.write("round\n")
            child.stdin.flush()
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"the old loop exited ({child.wait(10)})")
            time.sleep(0.3)
            results.append((json.loads(line)["seconds"], account(audit.take(), OLD_UA)))
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)
    warm, measured = results[0], results[1:]
    return {"warmup_round_s": round(warm[0], 3), "warmup_writes": warm[1]["writes"],
            "round_s_median": round(statistics.median(s for s, _ in measured), 3),
            "reads_per_round": [a["calls"] - a["writes"] for _, a in measured],
            "writes_per_round": [a["writes"] for _, a in measured],
            "calls_by_per_round": {k: v / len(measured)
                                   for k, v in merge([a for _, a in measured])["calls_by"].items()}}


# ---------------------------------------------------------------- main


def measure(plane: ControlPlane, args: argparse.Namespace, workdir: Path, out: dict[str, Any]) -> None:
    t0 = time.monotonic()
    hub = plane.add_cluster("hub", nodes=[], controllers=False)
    spokes = {f"spoke-{i:02d}": plane.add_cluster(f"spoke-{i:02d}", nodes=[], controllers=False)
              for i in range(args.spokes)}
    out["apiservers_up_s"] = round(time.monotonic() - t0, 1)
    for cluster in (hub, *spokes.values()):
        install_crds(cluster)
    for spoke in spokes.values():
        spoke.kubectl("create", "namespace", SYSTEM)
    hub.apply(*({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in [SYSTEM, *NAMESPACES]))
    beats = Heartbeats(spokes).start()
    loop: HubController | None = None
    try:
        hub_kube = bench_kube(hub)
        for i, (name, spoke) in enumerate(spokes.items()):
            hub_kube.create({"apiVersion": "v1", "kind": "Secret",
                             "metadata": {"name": f"{name}-kubeconfig", "namespace": SYSTEM},
                             "data": {"kubeconfig": base64.b64encode(spoke.kubeconfig.read_bytes()).decode()}})
            hub_kube.create({"apiVersion": API, "kind": "FleetCluster", "metadata": {"name": name},
                             "spec": {"provider": "bench", "region": REGIONS[i % len(REGIONS)],
                                      "capacity": {"cpuReplicas": 100_000},
                                      "connection": {"kubeconfigSecret": {"name": f"{name}-kubeconfig"}},
                                      "lease": LEASE}})
        rng = random.Random(args.seed)
        bodies = [embedding(f"emb-{i:05d}", NAMESPACES[i % len(NAMESPACES)], rng) for i in range(args.deployments)]
        t1 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(hub_kube.create, bodies))
        out["create_deployments_s"] = round(time.monotonic() - t1, 1)
        out["setup_s"] = round(time.monotonic() - t0, 1)

        audit = AuditTail([hub, *spokes.values()], hub.name)
        loop = HubController(Kube(load_client(hub.kubeconfig)), interval=1, ramp=0)
        # ---- placing everything
        place = until_converged(loop, audit, limit_s=240)
        items = hub_items(loop)
        copies = sum(len(link.copies.items()) for link in loop.state.links.values())
        wanted = sum(len([r for r in (o.get("status") or {}).get("clusters") or [] if r.get("desired")])
                     for o in items.values())
        out.update({
            "place_converged": place["converged"], "first_round_s": place["first_round_s"],
            "first_round_writes": place["first_round_writes"], "place_rounds": place["rounds"],
            "place_s": place["seconds"], "place_round_s": place["round_s"],
            "place_writes_per_round": place["writes_per_round"], "place_writes": place["total"]["writes"],
            "place_writes_by": place["total"]["writes_by"], "place_calls": place["total"]["calls"],
            "place_status_writes_per_deployment": round(
                place["total"]["writes_by"].get("hub:patch:embeddingdeployments/status", 0) / len(items), 2),
            "place_errors_by": place["total"]["errors_by"],
            "watch_opens_place": place["total"]["watch_opens"],
            "deployments_placed": sum(1 for o in items.values() if placed(o)),
            "copies": copies, "copies_expected": wanted,
            "replicas_on_spokes": sum(spoke_replicas(loop).values()),
            "replicas_wanted": sum(int(o["spec"]["replicas"]) for o in items.values()),
        })

        # ---- idle rounds
        steady = []
        for _ in range(args.rounds):
            time.sleep(args.gap)
            steady.append(one_round(loop, audit, 0.3))
        total = merge([a for _, a in steady])
        out.update({
            "steady_rounds": args.rounds, "steady_gap_s": args.gap,
            "steady_round_s_median": round(statistics.median(s for s, _ in steady), 3),
            "steady_round_s_max": round(max(s for s, _ in steady), 3),
            "steady_calls_per_round": [a["calls"] for _, a in steady],
            "steady_calls_by": total["calls_by"],
            "steady_writes_per_round": [a["writes"] for _, a in steady],
            "steady_writes_by": total["writes_by"],
            "watch_opens_steady": total["watch_opens"], "watch_opens_steady_by": total["watch_opens_by"],
        })

        # ---- a 5% change
        placeable = sorted(k for k, o in items.items() if placed(o))
        changed_keys = rng.sample(placeable, min(len(placeable), max(1, args.deployments * 5 // 100)))
        new_replicas = {}
        for key in changed_keys:
            old = int(items[key]["spec"]["replicas"])
            new_replicas[key] = old % 4 + 1 if items[key]["spec"]["placement"].get("minRegions") != 2 \
                else (old - 1) % 3 + 2  # minRegions 2 keeps 2-4
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: hub_kube.patch_merge("EmbeddingDeployment", k.split("/")[1], k.split("/")[0],
                                                         {"spec": {"replicas": new_replicas[k]}}), changed_keys))
        audit.take()  # the bench's patches are not the hub's; drop the window
        time.sleep(0.5)  # the hub's watch shows the patches
        change = until_converged(loop, audit, limit_s=120)
        on_spokes = spoke_replicas(loop)
        out.update({
            "change_deployments": len(changed_keys), "change_converged": change["converged"],
            "change_rounds": change["rounds"], "change_s": change["seconds"], "change_round_s": change["round_s"],
            "change_writes": change["total"]["writes"], "change_writes_by": change["total"]["writes_by"],
            "change_writes_per_changed": round(change["total"]["writes"] / len(changed_keys), 2),
            "change_applied_on_spokes": sum(1 for k in changed_keys if on_spokes.get(k) == new_replicas[k]),
            "change_errors_by": change["total"]["errors_by"],
        })
        after = one_round(loop, audit, 0.3)
        out["after_change_round_writes"] = after[1]["writes"]
        stats = [*loop.informers.values(),
                 *(i for link in loop.state.links.values() for i in (link.copies, link.lease))]
        out["informers"] = {"count": len(stats), "lists": sum(i.stats.lists for i in stats),
                            "relists": sum(i.stats.relists for i in stats),
                            "watches": sum(i.stats.watches for i in stats)}
        loop.close()
        loop = None
        time.sleep(0.5)
        audit.take()

        # ---- the loop as it was
        out["old_design_reads_per_round_computed"] = 2 * args.spokes + 3 + len(NAMESPACES)
        if args.old:
            try:
                old = old_design(hub, audit, args.rounds, workdir)
                out.update({f"old_design_{k}": v for k, v in old.items()})
                new_median = statistics.median(out["steady_calls_per_round"])
                out["old_design_reads_per_round_median"] = statistics.median(old["reads_per_round"])
                out["reads_per_round_ratio_new_vs_old"] = round(
                    new_median / out["old_design_reads_per_round_median"], 4)
            except Exception as exc:  # a measured baseline is a bonus; the computed figure stands without it
                out["old_design_error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["heartbeat_failures"] = beats.failures
    finally:
        if loop is not None:
            loop.close()
        beats.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spokes", type=int, default=10)
    parser.add_argument("--deployments", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5, help="idle rounds measured after convergence")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between idle rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-old", dest="old", action="store_false", help="skip the old loop's measurement")
    add_results_dir(parser, "hub-fleet-cpu.jsonl")
    args = parser.parse_args()
    head = {"bench": "hub_fleet", "spokes": args.spokes, "deployments": args.deployments,
            "namespaces": len(NAMESPACES), "regions": len(REGIONS)}
    reason = missing_reason()
    if reason:
        print(json.dumps({**head, "skipped": reason}))
        return 0
    facts = {"cpus": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                                         / 2**30, 1),
             "python": pyplatform.python_version(), "kube_apiserver": KUBE_VERSION}
    # the code measured: the hub's modules
    hub_package = Path(sys.modules[HubController.__module__].__file__ or "").parent
    loop_source = b"".join(p.read_bytes() for p in sorted(hub_package.glob("*.py")))
    workdir = Path(tempfile.mkdtemp(prefix="embedfleet-hub-fleet-"))
    out: dict[str, Any] = {}
    started = time.monotonic()
    plane = ControlPlane.start(workdir)
    try:
        measure(plane, args, workdir, out)
    finally:
        plane.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    result = {**head, **out, "total_s": round(time.monotonic() - started, 1),
              "hub_loop_sha256": hashlib.sha256(loop_source).hexdigest()[:12], "machine": facts}
    line = json.dumps(result)
    print(line)
    record("hub-fleet", result, results_dir=args.results_dir)

    return 0


if __name__ == "__main__":
    sys.exit(main())
