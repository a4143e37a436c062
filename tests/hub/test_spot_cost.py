"""A FleetCluster that prices a spot pool: a deployment with spec.spot is ranked and reported at its mix of
spot and on-demand prices; one without spec.spot is not (scheduling/inventory.py `prices`, place.py)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.crd.fleet import FleetClusterSpec
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.health import Health
from embedfleet.operator.scheduling import Cluster, Deployment, GPUCapacity, Intent, place
from embedfleet.operator.scheduling.explain import placement_line

H100 = "nvidia-h100"
# eu prices on-demand a little higher than us, but runs a spot pool at a third of it.
EU = Cluster("eu", "eu-west-1", gpus=(GPUCapacity(H100, 8, 4.2, spot_hourly_price=1.4),))
US = Cluster("us", "us-east-1", gpus=(GPUCapacity(H100, 8, 4.0),))
ONE_CLUSTER = Intent(max_clusters=1)


def _dep(spot_share: float) -> Deployment:
    return Deployment("ml/search", 2, 4, ONE_CLUSTER, gpu_type=H100, gpus_per_replica=1, model="bge-base",
                      spot_share=spot_share)


def test_a_spot_deployment_goes_where_its_mix_is_cheapest_and_says_so() -> None:
    with_spot = place([_dep(0.7)], [EU, US])["ml/search"]
    assert with_spot.desired() == {"eu": 2}
    share = with_spot.clusters["eu"]
    assert share.spot == 0.7 and math.isclose(share.price, 0.3 * 4.2 + 0.7 * 1.4)
    assert "up to 70% on spot" in " ".join(share.reasons)
    assert "eu (spot nvidia-h100 up to 70%" in placement_line(with_spot)
    # Without spec.spot the same fleet is ranked on demand: us is cheaper.
    without = place([_dep(0.0)], [EU, US])["ml/search"]
    assert without.desired() == {"us": 2} and without.clusters["us"].spot == 0.0
    assert "spot" not in placement_line(without)


def test_a_fleet_without_spot_prices_ranks_as_before() -> None:
    plain = [Cluster("eu", "eu-west-1", gpus=(GPUCapacity(H100, 8, 4.2),)), US]
    assert place([_dep(0.7)], plain)["ml/search"].desired() == {"us": 2}


@given(st.floats(0, 1), st.floats(0.01, 10), st.floats(0, 10))
def test_the_mix_lies_between_the_two_prices(share: float, on_demand: float, spot: float) -> None:
    cluster = Cluster("eu", "eu-west-1", gpus=(GPUCapacity(H100, 8, on_demand, spot_hourly_price=spot),))
    placed = place([_dep(share)], [cluster])["ml/search"].clusters["eu"]
    assert min(on_demand, spot) - 1e-9 <= placed.price <= max(on_demand, spot) + 1e-9


def test_the_hub_reads_spot_prices_and_shares_from_the_crds() -> None:
    spec = FleetClusterSpec.model_validate({"region": "eu-west-1", "connection": {"kubeconfigSecret": {"name": "eu"}},
                                            "capacity": {
        "cpuReplicas": 4, "cpuHourlyPrice": 0.2, "cpuSpotHourlyPrice": 0.06,
        "gpus": [{"type": H100, "count": 8, "hourlyPrice": 4.2, "spotHourlyPrice": 1.4}]}})
    cluster = convert.cluster_from("eu", spec, Health(joined=True, available=True), [])
    assert cluster.spot_price(H100) == 1.4 and cluster.spot_price("cpu") == 0.06
    ed = {"model": {"source": "hf://org/m", "digest": "sha256:" + "c" * 64}, "spot": {"max": "70%"}}
    assert convert.spot_share(EmbeddingDeploymentSpec.model_validate(ed), 10) == 0.7
    ed["spot"] = {"max": 3}
    assert convert.spot_share(EmbeddingDeploymentSpec.model_validate(ed), 10) == 0.3
    assert convert.spot_share(EmbeddingDeploymentSpec.model_validate(ed), 2) == 1.0
    del ed["spot"]
    assert convert.spot_share(EmbeddingDeploymentSpec.model_validate(ed), 10) == 0.0
