"""Kubernetes mode's bookkeeping (gateway/kube.py), pure: slices to replica URLs, deployments to routes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.kube import ClusterView, replica_urls, served_name


def slice_of(*endpoints: dict, port: int = 8080, port_name: str = "http") -> dict:
    return {"ports": [{"name": port_name, "port": port}], "endpoints": list(endpoints)}


def test_only_ready_endpoints_that_are_not_terminating_take_work():
    s = slice_of(
        {"addresses": ["198.18.0.5"], "conditions": {"ready": True}},
        {"addresses": ["198.18.0.6"], "conditions": {"ready": False}},  # starting
        {"addresses": ["198.18.0.7"], "conditions": {"ready": True, "terminating": True}},  # being deleted
        {"addresses": ["198.18.0.8"]},  # no conditions: ready, as the API defines it
        {"addresses": ["fd00::1"], "conditions": {"ready": True}},
    )
    assert replica_urls(s) == ["http://198.18.0.5:8080", "http://198.18.0.8:8080", "http://[fd00::1]:8080"]
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
