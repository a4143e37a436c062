"""ActivePassive's warm standby (scheduling/warm.py): while the primary regions serve, the standby region's
clusters get a copy with 0 replicas so their node agents keep the weights; a failover then starts warm."""

from __future__ import annotations

from hypothesis import given

from embedfleet.operator.hub import convert
from embedfleet.operator.scheduling import Cluster, Deployment, GPUCapacity, Intent, place
from embedfleet.operator.scheduling.model import WARM_ROLE
from tests.hub.test_scheduler import PROPS, clusters_st, deployments_st, down, replace

DIGEST = "sha256:" + "b" * 64
US = Cluster("us-a", "us-east-1", cpu_replicas=20, gpus=(GPUCapacity("nvidia-h100", 8, 4.0),))
EU1 = Cluster("eu-a", "eu-west-1", cpu_replicas=20, gpus=(GPUCapacity("nvidia-h100", 8, 4.0),))
EU2 = Cluster("eu-b", "eu-west-1", cpu_replicas=20, gpus=(GPUCapacity("nvidia-h100", 4, 4.0),))
AP = Cluster("ap-a", "ap-south-1", cpu_replicas=20, gpus=(GPUCapacity("nvidia-h100", 16, 4.0),))
FLEET = [US, EU1, EU2, AP]


def _dep(**changes: object) -> Deployment:
    base = {"key": "ml/search", "target": 4, "max_replicas": 8, "gpu_type": "nvidia-h100", "gpus_per_replica": 1,
            "digest": DIGEST, "intent": Intent(mode="ActivePassive", primary_regions=("us-east-1",))}
    return Deployment(**{**base, **changes})


def test_the_standby_region_keeps_the_weights_while_the_primary_serves() -> None:
    p = place([_dep()], FLEET)["ml/search"]
    assert p.desired() == {"us-a": 4}
    # No cluster reports the weights yet: the region with the most free GPUs (ap-south-1) would take a failover.
    assert p.warm == ("ap-a",)
    share = p.share("ap-a", "ap-south-1")
    assert share is not None and share.role == WARM_ROLE and share.range.max == 0
    assert p.share("eu-a") is None and p.share("us-a") is p.clusters["us-a"]


def test_a_region_that_already_holds_the_weights_is_kept_warm_first() -> None:
    fleet = [US, replace(EU1, cached_digests=frozenset({DIGEST})), EU2, AP]
    assert place([_dep()], fleet)["ml/search"].warm == ("eu-a", "eu-b")


def test_once_the_standby_serves_nothing_is_only_warm() -> None:
    p = place([_dep(intent=Intent(mode="ActivePassive", primary_regions=("us-east-1",), regions=("us-east-1",
                                                                                                "eu-west-1")))],
              [down(US), EU1, EU2, AP])["ml/search"]
    assert set(p.desired()) <= {"eu-a", "eu-b"} and p.placed == 4
    assert p.warm == ()


def test_other_modes_keep_nothing_warm() -> None:
    for intent in (Intent(), Intent(mode="RegionLocked", regions=("us-east-1",))):
        assert place([_dep(intent=intent)], FLEET)["ml/search"].warm == ()


def test_a_warm_copy_holds_no_replica_and_no_autoscaler() -> None:
    p = place([_dep()], FLEET)["ml/search"]
    hub_obj = {"metadata": {"name": "search", "namespace": "ml", "uid": "u"},
               "spec": {"model": {"source": "hf://org/m", "digest": DIGEST}, "cache": {"prePull": True},
                        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8},
                        "runtime": {"gpu": {"count": 1, "type": "nvidia-h100"}},
                        "placement": {"mode": "ActivePassive", "primaryRegions": ["us-east-1"]}}}
    share = p.share("ap-a", "ap-south-1")
    assert share is not None
    spec = convert.spoke_manifest(hub_obj, "ap-a", share)["spec"]
    assert spec["replicas"] == 0 and spec["autoscaling"]["enabled"] is False
    assert spec["cache"] == {"prePull": True} and spec["runtime"]["gpu"]["type"] == "nvidia-h100"
    assert "placement" not in spec
    assert "warm standby" in convert.spoke_row("ap-a", share, "ap-south-1", None, None)["reasons"]


@PROPS
@given(clusters_st(), deployments_st())
def test_warm_clusters_are_one_standby_region_that_runs_nothing(clusters: list[Cluster],
                                                                deps: list[Deployment]) -> None:
    result = place(deps, clusters)
    by_name = {c.name: c for c in clusters}
    for d in deps:
        p = result[d.key]
        if not p.warm:
            continue
        assert d.intent.mode == "ActivePassive"
        assert not set(p.warm) & set(p.clusters)
        assert len({by_name[n].region for n in p.warm}) == 1
        assert all(by_name[n].region not in d.intent.primary_regions for n in p.warm)
        assert all(by_name[n].region in d.intent.primary_regions for n in p.clusters)
        # Warm clusters passed the same filters as a failover's: available, and inside a region lock.
        assert all(by_name[n].available for n in p.warm)
        assert not d.intent.regions or all(by_name[n].region in d.intent.regions for n in p.warm)
