"""Kubernetes mode's bookkeeping (gateway/kube.py), pure: slices to replica URLs, deployments to routes."""

from __future__ import annotations

import asyncio

import aiohttp
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.bounds import Bounds, from_object, shed_bound, spill_after
from embedfleet.gateway.config import GatewayConfig
from embedfleet.gateway.fleet import Fleet
from embedfleet.gateway.kube import ClusterView, KubeSource, replica_urls, served_name
from embedfleet.operator.crd import EmbeddingDeploymentSpec
from embedfleet.operator.hub.convert import spoke_manifest
from embedfleet.operator.scheduling.model import ClusterPlacement, ReplicaRange


def slice_of(*endpoints: dict, port: int = 8080, port_name: str = "http") -> dict:
    return {"ports": [{"name": port_name, "port": port}], "endpoints": list(endpoints)}


def test_endpoints_that_are_not_terminating_are_replicas_starting_ones_too():
    """A starting endpoint is a replica the gateway polls; it gets work once its own /load says ready."""
    s = slice_of(
        {"addresses": ["198.18.0.5"], "conditions": {"ready": True}},
        {"addresses": ["198.18.0.6"], "conditions": {"ready": False}},  # starting
        {"addresses": ["198.18.0.7"], "conditions": {"ready": True, "terminating": True}},  # being deleted
        {"addresses": ["198.18.0.9"], "conditions": {"ready": False, "terminating": True}},  # being deleted
        {"addresses": ["198.18.0.8"]},  # no conditions: ready, as the API defines it
        {"addresses": ["fd00::1"], "conditions": {"ready": True}},
    )
    assert replica_urls(s) == ["http://198.18.0.5:8080", "http://198.18.0.6:8080", "http://198.18.0.8:8080",
                               "http://[fd00::1]:8080"]
    assert replica_urls({"ports": [], "endpoints": s["endpoints"]}) == [], "no port: no replica"
    assert replica_urls(slice_of({"addresses": ["198.18.0.5"]}, port_name="other")) == ["http://198.18.0.5:8080"]


def test_served_name_is_the_models_or_the_objects_name():
    named = {"metadata": {"name": "bge"}, "spec": {"model": {"servedModelName": "bge-large"}}}
    assert served_name(named) == "bge-large"
    assert served_name({"metadata": {"name": "bge"}, "spec": {"model": {}}}) == "bge"


def test_routes_join_deployments_and_their_slices_and_a_name_served_twice_goes_one_way():
    view = ClusterView(
        deployments={"a/bge": "bge", "b/bge": "bge", "a/minilm": "minilm"},
        slices={"a/bge-x1": ("a/bge", ["http://198.18.0.5:8080"]), "a/bge-x2": ("a/bge", ["http://198.18.0.6:8080"]),
                "b/bge-x1": ("b/bge", ["http://198.18.0.9:8080"]), "c/other": ("c/other", ["http://198.18.1.1:80"])},
    )
    assert view.routes() == {"bge": ("a/bge", ["http://198.18.0.5:8080", "http://198.18.0.6:8080"]),
                             "minilm": ("a/minilm", [])}


@given(st.dictionaries(st.from_regex(r"[a-c]/[a-e]{1,3}", fullmatch=True), st.sampled_from(["m1", "m2", "m3"])))
def test_every_model_routes_to_exactly_one_of_its_deployments(deployments):
    routes = ClusterView(deployments=dict(deployments)).routes()
    assert set(routes) == set(deployments.values())
    for model, (key, urls) in routes.items():
        assert deployments[key] == model and urls == []
        assert key == min(k for k, m in deployments.items() if m == model), "stable: the first by key"


def test_the_hubs_spill_annotation_is_read_from_each_deployment():
    from embedfleet.gateway.kube import spill_annotation
    from embedfleet.gateway.spill import ANNOTATION, parse_annotation

    raw = '[{"cluster":"us-1","region":"us-east-1","url":"https://gw.us.example"}]'
    obj = {"metadata": {"name": "bge", "annotations": {ANNOTATION: raw}}}
    assert [t.region for t in parse_annotation(spill_annotation(obj))] == ["us-east-1"]
    assert spill_annotation({"metadata": {"name": "bge"}}) == ""


# -- per-deployment bounds (bounds.py): from the EmbeddingDeployment watch to the fleet's deployment state


def embedding_deployment(name: str, runtime: dict | None = None, placement: dict | None = None,
                         revisions: list[dict] | None = None) -> dict:
    status = {"currentRevision": "r2", "queryVectorSpace": "r2", "revisions": revisions or []}
    return {"metadata": {"name": name, "namespace": "team"},
            "spec": {"model": {"servedModelName": name}, "runtime": runtime or {}, "placement": placement or {}},
            "status": status}


def test_a_deployments_own_bounds_reach_its_main_and_revision_services_and_the_fleet():
    side_by_side = [{"name": "r1", "vectorSpace": "r1", "state": "SideBySide"},
                    {"name": "r2", "vectorSpace": "r2", "state": "Serving"}]
    own = embedding_deployment("bge", {"maxQueueSeconds": 1.5, "maxQueueSecondsBulk": 12},
                               {"spillAfterSeconds": 0}, side_by_side)
    plain = embedding_deployment("minilm")
    source = KubeSource(None, [], lambda *_: None, None)  # type: ignore[arg-type]  # no I/O: handlers only
    source._on_deployment("RESET", {"items": [own, plain]}, None)
    bounds = source.view.service_bounds()
    mine = Bounds(max_queue_s=1.5, max_queue_bulk_s=12.0, spill_after_s=0.0)
    assert bounds == {"team/bge": mine, "team/bge-r1": mine, "team/minilm": Bounds()}

    config = GatewayConfig(max_queue_seconds=5.0, max_queue_seconds_bulk=30.0, spill_after=2.0)

    async def applied() -> dict[str, Bounds]:
        async with aiohttp.ClientSession() as polls:  # never used: nothing here polls
            fleet = Fleet(config, polls)
            fleet.set_routes(source.view.routes(), source.view.spaces(), bounds)
            return {key: d.bounds for key, d in fleet.deployments.items()}

    state = asyncio.run(applied())
    assert state == {"team/bge": mine, "team/bge-r1": mine, "team/minilm": Bounds()}
    assert shed_bound(state["team/bge-r1"], config, bulk=False).seconds == 1.5  # the revision's Service too
    assert shed_bound(state["team/bge"], config, bulk=True).source == "spec.runtime.maxQueueSecondsBulk"
    assert spill_after(state["team/bge"], config).seconds == 0.0  # 0 is a value, not "unset"
    assert shed_bound(state["team/minilm"], config, bulk=False).seconds == 5.0  # unset: the flags
    assert spill_after(state["team/minilm"], config).source == "--spill-after"

    # an edit takes effect; deleting the deployment forgets its bounds
    edited = embedding_deployment("bge", {"maxQueueSeconds": 3})
    source._on_deployment("MODIFIED", edited, None)
    assert source.view.service_bounds()["team/bge"] == Bounds(max_queue_s=3.0)
    source._on_deployment("DELETED", edited, None)
    assert "team/bge" not in source.view.bounds and "team/bge" not in source.view.service_bounds()


@given(st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=True, allow_infinity=True),
                 st.integers(-5, 5)))
def test_a_bound_the_schema_would_refuse_falls_back_to_the_flag(value):
    got = from_object({"spec": {"runtime": {"maxQueueSeconds": value}, "placement": {"spillAfterSeconds": value}}})
    usable = isinstance(value, int | float) and not isinstance(value, bool) and value == value \
        and abs(value) != float("inf") and value >= 0
    assert got.max_queue_s == got.spill_after_s == (float(value) if usable else None)
    assert got.max_queue_bulk_s is None


def test_a_spoke_copy_keeps_the_bounds_its_gateway_reads():
    """The hub strips placement from a spoke's copy, all but spillAfterSeconds: spill happens at the spokes'
    gateways, which read it (and the runtime's queue bounds) from that copy."""
    spec = {"model": {"source": "hf://x"}, "runtime": {"maxQueueSeconds": 4, "maxQueueSecondsBulk": 20},
            "placement": {"mode": "ActiveActive", "regions": ["eu-west-1"], "spillAfterSeconds": 0.5}}
    hub_obj = {"metadata": {"name": "a", "namespace": "ml", "uid": "u1"}, "spec": spec}
    share = ClusterPlacement(ReplicaRange(1, 1, 3), "eu-west-1", "cpu")
    copy = spoke_manifest(hub_obj, "eu-a", share, [])
    assert copy["spec"]["placement"] == {"spillAfterSeconds": 0.5}
    EmbeddingDeploymentSpec.model_validate(copy["spec"])  # still a valid spec for the spoke's API server
    assert from_object(copy) == Bounds(max_queue_s=4.0, max_queue_bulk_s=20.0, spill_after_s=0.5)
    del spec["placement"]["spillAfterSeconds"]
    assert "placement" not in spoke_manifest(hub_obj, "eu-a", share, [])["spec"]
