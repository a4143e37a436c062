"""Hub + three spokes in two regions, each its own kmock emulator, with real operator processes
(`embedfleet operator run --role hub|spoke`). Short intervals: heartbeat 0.5 s, lease 1 s, grace 3 s,
scheduling every 1 s, return ramp 4 s.

The emulator has no controllers and sets no uid, so spokes' EmbeddingDeployments never get pods here;
the test plays a spoke reporting status by patching it, and checks every object against its CRD schema.
"""

from __future__ import annotations

import base64
import sys
import time
from typing import Any

from embedfleet.operator.crd import naming
from tests.hub.conftest import EXTRA, FLEET_CLUSTERS, op, schema_helpers, wait_for

ED = op.EMBEDDING
NS = "ml"
SYSTEM = "embedfleet-system"
SPOKES = {"eu-a": "eu-west-1", "eu-b": "eu-west-1", "us-a": "us-east-1"}
SPOKE_ENV = {"EMBEDFLEET_HEARTBEAT_INTERVAL": "0.5", "EMBEDFLEET_LEASE_DURATION": "1",
             "EMBEDFLEET_NAMESPACE": SYSTEM}
HUB_ENV = {"EMBEDFLEET_HUB_INTERVAL": "1", "EMBEDFLEET_HUB_RAMP_SECONDS": "4"}
assert EXTRA


def run_argv(role: str) -> list[str]:
    return [sys.executable, "-m", "embedfleet.runtime.cli", "operator", "run", "--role", role, "-A",
            "--liveness", "{liveness}"]


def hub_ed(name: str, placement: dict[str, Any], min_replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": naming.API_VERSION,
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1, "resourceVersion": "1"},
        "spec": {
            "model": {"source": "https://weights.example/minilm.tar", "digest": "sha256:" + "ab" * 32},
            "autoscaling": {"minReplicas": min_replicas, "maxReplicas": min_replicas * 2},
            "placement": placement,
        },
    }


def spoke_min(spoke: Any, name: str) -> int | None:
    obj = spoke.get(ED, NS, name)
    return None if obj is None else int(obj["spec"]["autoscaling"]["minReplicas"])


def shares(spokes: dict[str, Any], name: str) -> dict[str, int]:
    out = {}
    for cname, spoke in spokes.items():
        value = spoke_min(spoke, name)
        if value is not None:
            out[cname] = value
    return out


def test_fleet_region_lock_spread_failover_return_and_status(clusters: Any, operator_process: Any) -> None:
    hub = clusters("hub")
    spokes = {name: clusters(name) for name in SPOKES}
    procs = {}
    for name, spoke in spokes.items():
        procs[name] = operator_process(spoke.kubeconfig_path, {**SPOKE_ENV, "EMBEDFLEET_REGION": SPOKES[name]},
                                       argv=run_argv("spoke"))
    for name, spoke in spokes.items():
        secret = base64.b64encode(spoke.kubeconfig_path.read_bytes()).decode()
        hub.create("v1/secrets", SYSTEM, {"apiVersion": "v1", "metadata": {"name": f"{name}-kubeconfig",
                                                                           "namespace": SYSTEM},
                                          "data": {"kubeconfig": secret}})
        fc = {"apiVersion": naming.API_VERSION, "metadata": {"name": name},
              "spec": {"provider": "gcp", "region": SPOKES[name], "capacity": {"cpuReplicas": 20},
                       "connection": {"kubeconfigSecret": {"name": f"{name}-kubeconfig"}},
                       "lease": {"durationSeconds": 1, "graceSeconds": 3}}}
        assert schema_helpers.cr_errors("FleetCluster", fc) == []
        hub.create(FLEET_CLUSTERS, None, fc)
    locked = hub_ed("locked", {"mode": "RegionLocked", "regions": ["eu-west-1"]}, 4)
    spread = hub_ed("spread", {"mode": "ActiveActive", "minRegions": 2,
                               "weights": [{"cluster": "eu-a", "weight": 3}, {"cluster": "eu-b", "weight": 1},
                                           {"cluster": "us-a", "weight": 2}]}, 6)
    for obj in (locked, spread):
        assert schema_helpers.cr_errors("EmbeddingDeployment", obj) == []
        hub.create(ED, NS, obj)
    operator_process(hub.kubeconfig_path, HUB_ENV, argv=run_argv("hub"))

    # Inventory: every spoke joins and is available.
    def available(name: str) -> bool:
        fc = hub.get(FLEET_CLUSTERS, None, name) or {}
        conds = {c["type"]: c["status"] for c in (fc.get("status") or {}).get("conditions") or []}
        return conds.get("Joined") == "True" and conds.get("Available") == "True"

    wait_for(lambda: all(available(n) for n in SPOKES), timeout=60, what="all spokes Available")
    fc = hub.get(FLEET_CLUSTERS, None, "eu-a")
    assert fc is not None and fc["status"]["lastHeartbeat"] and schema_helpers.cr_errors("FleetCluster", fc) == []

    # Region-locked: only the in-region spokes get it; active-active: spread 3:1:2.
    wait_for(lambda: shares(spokes, "locked") == {"eu-a": 2, "eu-b": 2}, timeout=30, what="locked in eu-west-1")
    wait_for(lambda: shares(spokes, "spread") == {"eu-a": 3, "eu-b": 1, "us-a": 2}, timeout=30, what="3:1:2")
    copy_ = spokes["eu-a"].get(ED, NS, "locked")
    assert copy_ is not None and "placement" not in copy_["spec"]
    assert copy_["metadata"]["labels"]["embedfleet.dev/hub-managed"] == "eu-a"
    assert schema_helpers.cr_errors("EmbeddingDeployment", copy_) == []
    assert spokes["us-a"].get(ED, NS, "locked") is None

    # A spoke-side edit of a hub-managed object is reverted.
    spokes["eu-b"].patch(ED, NS, "locked", {"spec": {"autoscaling": {"minReplicas": 9}}})
    wait_for(lambda: spoke_min(spokes["eu-b"], "locked") == 2, timeout=20, what="spoke edit reverted")

    # Spokes report; the hub aggregates per cluster.
    spokes["eu-b"].patch(ED, NS, "locked", {"status": {"replicas": {"ready": 2}, "inFlight": 5}},
                         subresource="status")

    def rows(name: str) -> dict[str, dict[str, Any]]:
        obj = hub.get(ED, NS, name) or {}
        return {r["name"]: r for r in (obj.get("status") or {}).get("clusters") or []}

    wait_for(lambda: rows("locked").get("eu-b", {}).get("ready") == 2, timeout=20, what="aggregated ready")
    row = rows("locked")["eu-b"]
    assert row["region"] == "eu-west-1" and row["inflight"] == 5 and row["desired"] == 2 and row["lastSeen"]
    assert set(rows("spread")) == {"eu-a", "eu-b", "us-a"}
    hub_locked = hub.get(ED, NS, "locked")
    assert hub_locked is not None and schema_helpers.cr_errors("EmbeddingDeployment", hub_locked) == []
    conds = {c["type"]: c for c in hub_locked["status"]["conditions"]}
    assert conds["Accepted"]["status"] == "True" and conds["Placed"]["status"] == "True"
    assert conds["Available"]["status"] == "True"

    # Stop eu-a's heartbeat: after lease + grace its share moves, never out of eu-west-1 for "locked".
    procs["eu-a"].stop()
    stopped = time.monotonic()
    seen_locked: list[dict[str, int]] = []

    def failed_over() -> bool:
        now_locked = {k: v for k, v in rows("locked").items() if v["desired"]}
        seen_locked.append({k: v["desired"] for k, v in now_locked.items()})
        spread_rows = {k: v["desired"] for k, v in rows("spread").items() if v["desired"]}
        return set(now_locked) == {"eu-b"} and spread_rows == {"eu-b": 2, "us-a": 4}

    wait_for(failed_over, timeout=30, interval=0.3, what="failover of eu-a's share")
    assert time.monotonic() - stopped >= 1.0  # not on a single missed heartbeat
    assert all(set(s) <= {"eu-a", "eu-b"} for s in seen_locked)  # never to us-east-1
    wait_for(lambda: spoke_min(spokes["eu-b"], "locked") == 4, timeout=10, what="eu-b takes all of locked")
    assert spokes["us-a"].get(ED, NS, "locked") is None
    assert not available("eu-a")

    # Bring it back: replicas return (gradually, over the ramp), to the original split.
    procs["eu-a"] = operator_process(spokes["eu-a"].kubeconfig_path,
                                     {**SPOKE_ENV, "EMBEDFLEET_REGION": "eu-west-1"}, argv=run_argv("spoke"))
    history: list[dict[str, int]] = []

    def returned() -> bool:
        current = shares(spokes, "spread")
        history.append(current)
        return current == {"eu-a": 3, "eu-b": 1, "us-a": 2}

    wait_for(returned, timeout=40, interval=0.3, what="replicas back on eu-a")
    wait_for(lambda: shares(spokes, "locked") == {"eu-a": 2, "eu-b": 2}, timeout=20, what="locked back")
    assert available("eu-a")
    eu_a_steps = [h.get("eu-a", 0) for h in history]
    # Its stale copy (left while it was unreachable) is first brought down to its ramp share, then the
    # share grows back monotonically over the ramp, never overshooting.
    after_reset = eu_a_steps[eu_a_steps.index(0):] if 0 in eu_a_steps else eu_a_steps
    assert after_reset == sorted(after_reset) and after_reset[-1] == 3
