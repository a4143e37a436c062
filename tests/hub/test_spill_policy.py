"""Which clusters a deployment's requests may spill to (scheduling/spill.py), and how the hub hands it to a
spoke's copy. Real placements from `place`, so the policy's own filters decide what may be named."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.spill import parse_annotation
from embedfleet.operator.hub.convert import SPILL_ANNOTATION, spoke_manifest
from embedfleet.operator.scheduling import Deployment, Intent, place
from embedfleet.operator.scheduling.spill import spill_targets
from tests.hub.test_scheduler import EU1, EU2, EU3, FLEET, US1, US2, down

GATEWAYS = {c.name: f"https://gw.{c.name}.example" for c in FLEET}


def placed(intent: Intent, clusters=FLEET, target: int = 4):
    dep = Deployment("ml/a", target, 8, intent)
    return place([dep], clusters, [], 0.0)[dep.key]


def test_active_active_spills_to_every_other_placed_cluster_with_a_gateway():
    placement = placed(Intent(mode="ActiveActive", regions=("eu-west-1", "us-east-1")))
    assert set(placement.clusters) >= {"eu-a", "us-a"}
    names = [t["cluster"] for t in spill_targets(placement, "eu-a", GATEWAYS)]
    assert "eu-a" not in names and "us-a" in names
    assert set(names) == set(placement.clusters) - {"eu-a"}
    without = spill_targets(placement, "eu-a", {k: v for k, v in GATEWAYS.items() if k != "us-a"})
    assert "us-a" not in [t["cluster"] for t in without], "no gateway address: nothing can be sent there"


def test_region_locked_never_names_a_cluster_outside_its_regions():
    placement = placed(Intent(mode="RegionLocked", regions=("eu-west-1",)))
    targets = spill_targets(placement, "eu-a", GATEWAYS)
    assert [t["cluster"] for t in targets] == ["eu-b"]
    assert all(t["region"] == "eu-west-1" for t in targets)
    # its region's only other cluster down: nowhere to go, even though other regions have room
    alone = placed(Intent(mode="RegionLocked", regions=("eu-west-1",)), [EU1, down(EU2), EU3, US1, US2])
    assert spill_targets(alone, "eu-a", GATEWAYS) == []


def test_active_passive_spills_only_to_a_standby_that_runs():
    """While the primary region is up the standby runs nothing, so there is nowhere to spill (not even the
    other primary cluster: the policy names the standby only); after a failover the standby serves."""
    intent = Intent(mode="ActivePassive", primary_regions=("eu-west-1",), regions=("eu-west-1", "us-east-1"))
    primary_up = placed(intent)
    assert set(primary_up.clusters) == {"eu-a", "eu-b"}
    assert spill_targets(primary_up, "eu-a", GATEWAYS) == []
    us_c = type(US1)(**{**{f: getattr(US1, f) for f in US1.__slots__}, "name": "us-c"})
    failed_over = placed(intent, [down(EU1), down(EU2), EU3, US1, us_c, US2])
    assert set(failed_over.clusters) == {"us-a", "us-c"}
    targets = spill_targets(failed_over, "us-a", {**GATEWAYS, "us-c": "https://gw.us-c"})
    assert [t["cluster"] for t in targets] == ["us-c"]


def test_the_spoke_copy_carries_the_targets_its_gateway_reads():
    placement = placed(Intent(mode="ActiveActive", regions=("eu-west-1", "us-east-1")))
    hub_obj = {"metadata": {"name": "a", "namespace": "ml", "uid": "u1"},
               "spec": {"model": {"source": "hf://x"}, "placement": {"mode": "ActiveActive"}}}
    targets = spill_targets(placement, "eu-a", GATEWAYS)
    copy = spoke_manifest(hub_obj, "eu-a", placement.clusters["eu-a"], targets)
    raw = copy["metadata"]["annotations"][SPILL_ANNOTATION]
    assert json.loads(raw) == targets
    assert [(t.region, t.url) for t in parse_annotation(raw)] == [(t["region"], t["url"]) for t in targets]
    bare = spoke_manifest(hub_obj, "eu-a", placement.clusters["eu-a"], [])
    assert SPILL_ANNOTATION not in bare["metadata"]["annotations"], "nowhere to spill: no annotation at all"


def test_a_cluster_whose_copy_has_no_ready_replica_is_not_a_target():
    """A spilled request is never spilled again: naming a cluster that is itself cold would only hold the
    request there. Targets come back as soon as their copy reports a ready replica."""
    placement = placed(Intent(mode="ActiveActive", regions=("eu-west-1", "us-east-1")))
    others = [t["cluster"] for t in spill_targets(placement, "eu-a", GATEWAYS)]
    assert len(others) >= 2
    cold, warm = others[0], others[1:]
    ready = {name: 1 for name in warm} | {cold: 0}
    assert [t["cluster"] for t in spill_targets(placement, "eu-a", GATEWAYS, ready)] == warm
    # a cluster the hub has no copy reading for is not known to serve: not named
    assert [t["cluster"] for t in spill_targets(placement, "eu-a", GATEWAYS, {warm[0]: 2})] == [warm[0]]
    assert spill_targets(placement, "eu-a", GATEWAYS, {}) == []
    assert [t["cluster"] for t in spill_targets(placement, "eu-a", GATEWAYS, ready | {cold: 3})] == others


@given(st.dictionaries(st.sampled_from([c.name for c in FLEET]), st.integers(0, 3)))
def test_ready_only_ever_narrows_the_policys_targets(ready):
    placement = placed(Intent(mode="ActiveActive", regions=("eu-west-1", "us-east-1")))
    policy = [t["cluster"] for t in spill_targets(placement, "eu-a", GATEWAYS)]
    narrowed = [t["cluster"] for t in spill_targets(placement, "eu-a", GATEWAYS, ready)]
    assert narrowed == [c for c in policy if ready.get(c, 0) > 0]
