"""Pinning's decisions, pure (gateway/pinning.py, kube.py ClusterView, the fleet's picks, no sockets): which
names an EmbeddingDeployment answers mid-rollout, in which vector space, and that a request never goes to
a replica of another space."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.config import ConfigError, GatewayConfig, parse_vector_spaces
from embedfleet.gateway.errors import Refused
from embedfleet.gateway.fleet import Fleet
from embedfleet.gateway.kube import KubeSource
from embedfleet.gateway.pick import State
from embedfleet.gateway.pinning import (
    effective_space,
    eligible,
    is_mismatch,
    label,
    revision_services,
    serves_elsewhere,
    space_of_cards,
    spaces_of_header,
)
from embedfleet.gateway.upstreams import Replica

A, B, C = "http://198.18.0.5:8080", "http://198.18.0.6:8080", "http://198.18.0.7:8080"


def revision(name: str, space: str, state: str) -> dict:
    return {"name": name, "hash": "h" + name, "source": "hf://x", "vectorSpace": space, "state": state}


def deployment(name: str = "bge", served: str | None = "bge-large", *, current: str | None = None,
               query: str | None = None, revisions: list[dict] | None = None, namespace: str = "a") -> dict:
    status = {"currentRevision": current, "queryVectorSpace": query, "revisions": revisions}
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"servedModelName": served} if served else {}},
            "status": {k: v for k, v in status.items() if v is not None}}


def endpoint_slice(name: str, service: str, *addresses: str, namespace: str = "a") -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses]}


def view_of(eds: list[dict], slices: list[dict]) -> KubeSource:
    """The watch handlers fed the lists a real API server answers (no I/O: KubeSource only stores its client)."""
    source = KubeSource(None, [], lambda *_: None, None)  # type: ignore[arg-type]
    source._on_deployment("RESET", {"items": eds}, None)
    source._on_slice("RESET", {"items": slices}, None)
    return source


SLICES = [endpoint_slice("bge-x1", "bge", "198.18.0.5"), endpoint_slice("bge-r2-x1", "bge-r2", "198.18.0.6"),
          endpoint_slice("bge-r1-x1", "bge-r1", "198.18.0.7")]


def test_a_breaking_revision_side_by_side_answers_its_own_name_in_its_own_space():
    ed = deployment(current="r1", query="r1", revisions=[
        revision("r1", "r1", "Serving"), revision("r2", "r2", "SideBySide"),
        revision("r3", "ungated", "Candidate"), revision("r4", "r4", "Blocked"), revision("r5", "r5", "Retired")])
    view = view_of([ed], SLICES).view
    assert view.routes() == {"bge-large": ("a/bge", ["http://198.18.0.5:8080"]),
                             "bge-large@r2": ("a/bge-r2", ["http://198.18.0.6:8080"])}
    assert view.spaces() == {"a/bge": "r1", "a/bge-r2": "r2"}


def test_after_the_flip_the_bare_name_pins_the_new_space_and_the_old_revision_answers_by_name_while_it_drains():
    ed = deployment(current="r2", query="r2", revisions=[revision("r1", "r1", "Draining"),
                                                         revision("r2", "r2", "Serving")])
    view = view_of([ed], SLICES).view
    assert view.routes() == {"bge-large": ("a/bge", ["http://198.18.0.5:8080"]),
                             "bge-large@r1": ("a/bge-r1", ["http://198.18.0.7:8080"])}
    assert view.spaces() == {"a/bge": "r2", "a/bge-r1": "r1"}
    retired = deployment(current="r2", query="r2", revisions=[revision("r1", "r1", "Retired"),
                                                              revision("r2", "r2", "Serving")])
    assert set(view_of([retired], SLICES).view.routes()) == {"bge-large"}, "a retired revision answers no name"


def test_a_compatible_revision_keeps_its_space_and_before_any_status_nothing_is_pinned():
    ed = deployment(current="r2", query="r1", revisions=[revision("r1", "r1", "Retired"),
                                                         revision("r2", "r1", "Serving")])
    assert view_of([ed], SLICES).view.spaces() == {"a/bge": "r1"}
    fresh = view_of([deployment(served=None)], SLICES).view
    assert fresh.routes() == {"bge": ("a/bge", ["http://198.18.0.5:8080"])} and fresh.spaces() == {"a/bge": None}


def test_a_watch_event_updates_and_a_deletion_forgets_the_revision_routes():
    source = view_of([deployment(current="r1", query="r1", revisions=[revision("r1", "r1", "Serving")])], SLICES)
    assert set(source.view.routes()) == {"bge-large"}
    source._on_deployment("MODIFIED", deployment(current="r1", query="r1", revisions=[
        revision("r1", "r1", "Serving"), revision("r2", "r2", "SideBySide")]), None)
    assert source.view.spaces() == {"a/bge": "r1", "a/bge-r2": "r2"}
    source._on_deployment("DELETED", deployment(), None)
    assert source.view.routes() == {} and source.view.spaces() == {}


STATES = st.sampled_from(["Serving", "Candidate", "SideBySide", "Draining", "Blocked", "Retired"])


@given(st.lists(st.tuples(st.integers(1, 9), STATES), max_size=6, unique_by=lambda t: t[0]), st.integers(1, 9))
def test_only_live_revisions_that_are_not_current_get_a_name_and_the_bare_name_always_resolves(revs, current):
    ed = deployment(current=f"r{current}", query=f"r{current}",
                    revisions=[revision(f"r{n}", f"s{n}", state) for n, state in revs])
    names = revision_services(ed, "m")
    assert names[0] == ("m", "bge", f"r{current}")
    expected = {(f"m@r{n}", f"bge-r{n}", f"s{n}") for n, state in revs
                if n != current and state in ("Serving", "SideBySide", "Draining")}
    assert set(names[1:]) == expected


# -- a replica's space


def replica(url: str, space: str | None, state: State = State.READY) -> Replica:
    return Replica("m", url, state=state, vector_space=space)


def test_a_names_space_is_the_declared_one_else_the_first_routable_listed():
    down, one, two = replica(A, "r1", State.DOWN), replica(B, "r2"), replica(C, "r1")
    assert effective_space("r9", [one, two]) == "r9"
    assert effective_space(None, [down, one, two]) == "r2", "the first routable one listed"
    assert effective_space(None, [down]) == "r1", "none routable: the first that ever said"
    assert effective_space(None, [replica(A, None)]) is None


def test_only_a_replica_that_said_another_space_is_kept_off():
    assert eligible(replica(A, "r1"), "r1") and eligible(replica(A, None), "r1") and eligible(replica(A, "r2"), None)
    assert not eligible(replica(A, "r2"), "r1")
    assert serves_elsewhere([replica(A, "r1"), replica(B, "r3")], "r2")
    assert not serves_elsewhere([replica(A, "r1"), replica(B, None)], "r2"), "one that said nothing may serve it"
    assert not serves_elsewhere([], "r2")


def test_the_space_is_read_from_the_models_card_or_the_one_all_cards_share():
    cards = {"data": [{"id": "m", "vector_space": "r2"}, {"id": "other", "vector_space": "weights-abc"}]}
    assert space_of_cards(cards, "m") == "r2" and space_of_cards(cards, "m@r2") == "r2"
    assert space_of_cards(cards, "x") is None, "several spaces and none is the model's"
    assert space_of_cards({"data": [{"id": "served", "vector_space": "r1"}]}, "ns/name") == "r1"
    for bad in (None, {}, {"data": "no"}, {"data": [{"id": "m"}]}, {"data": [{"id": "m", "vector_space": 3}]}):
        assert space_of_cards(bad, "m") is None, bad
    assert spaces_of_header("r1, r2") == {"r1", "r2"} and spaces_of_header(None) == frozenset()


def test_a_runtime_default_space_is_not_pinned_on():
    # `weights-...` says which files a process loaded, not which revision the platform meant the name to be
    cards = {"data": [{"id": "m", "vector_space": "weights-0123456789ab"}]}
    assert space_of_cards(cards, "m") is None
    assert label("weights-0123456789ab") is None and label("r2") == "r2" and label("") is None and label(None) is None


def test_only_a_409_vector_space_mismatch_is_a_refusal_for_the_space():
    body = b'{"error": {"message": "pinned to r2", "type": "vector_space_mismatch", "code": "vector_space_mismatch"}}'
    assert is_mismatch(409, body)
    assert not is_mismatch(200, body) and not is_mismatch(409, b'{"error": {"code": "conflict"}}')
    assert not is_mismatch(409, b"not json") and not is_mismatch(409, b"[]")


def test_the_vector_space_flag_names_one_space_per_served_name():
    assert parse_vector_spaces(["m=r2", "m@r1 = r1"]) == {"m": "r2", "m@r1": "r1"}
    for bad in ("m", "=r1", "m=", "m=r1,r2"):
        with pytest.raises(ConfigError, match="--vector-space"):
            parse_vector_spaces([bad])


# -- the fleet never sends a request to another space's replica


def scenario(test, **config):
    async def run():
        async with aiohttp.ClientSession() as polls:  # never used: nothing here polls
            fleet = Fleet(GatewayConfig(upstreams={"m": [A, B], "m@r1": [C]}, **config), polls, random.Random(0))
            return await test(fleet)
    return asyncio.run(run())


def test_picks_go_only_to_the_first_routable_replicas_space():
    async def test(fleet: Fleet):
        rs = {r.url: r for r in fleet.upstreams.replicas("m")}
        rs[A].state, rs[A].vector_space = State.READY, "r1"
        rs[B].state, rs[B].vector_space = State.READY, "r2"
        d = fleet.resolve("m")
        for _ in range(50):  # least-wait would spread them over both replicas were it not for the pin
            ticket = fleet.begin(d)
            got = await fleet.acquire(d, ticket, None)
            assert got is rs[A] and ticket.space == "r1"
        rs[A].state = State.DOWN
        ticket = fleet.begin(d)
        assert await fleet.acquire(d, ticket, None) is rs[B] and ticket.space == "r2", "then the next one listed"
    scenario(test)


def test_a_held_request_is_released_only_to_a_replica_of_its_space():
    async def test(fleet: Fleet):
        rs = {r.url: r for r in fleet.upstreams.replicas("m")}
        rs[A].vector_space, rs[B].vector_space = "r2", "r1"
        d = fleet.resolve("m")
        ticket = fleet.begin(d)
        ticket.space, ticket.pinned = "r2", True
        waiting = asyncio.ensure_future(fleet.acquire(d, ticket, None))
        while not len(d.held):
            await asyncio.sleep(0)
        rs[B].state = State.READY  # the other space comes up first: the request stays held
        fleet._replicas_changed("m")
        await asyncio.sleep(0)
        assert not waiting.done() and len(d.held) == 1
        rs[A].state = State.READY
        fleet._replicas_changed("m")
        assert await waiting is rs[A]
    scenario(test, hold_timeout=30)


def test_a_request_pinned_to_a_space_served_nowhere_here_is_refused_at_once_with_409():
    async def test(fleet: Fleet):
        for r in fleet.upstreams.replicas("m"):
            r.state, r.vector_space = State.READY, "r1"
        d = fleet.resolve("m", "r2")
        ticket = fleet.begin(d)
        ticket.model, ticket.space, ticket.pinned = "m", "r2", True
        with pytest.raises(Refused) as refused:
            await fleet.acquire(d, ticket, None)
        assert refused.value.status == 409 and refused.value.code == "vector_space_mismatch"
        assert "'r2'" in refused.value.message and "'r1'" in refused.value.message
    scenario(test, hold_timeout=30)


def test_a_pinned_request_goes_to_the_revision_of_its_space_under_the_same_model():
    async def test(fleet: Fleet):
        for r in fleet.upstreams.replicas("m"):
            r.state, r.vector_space = State.READY, "r2"
        (old,) = fleet.upstreams.replicas("m@r1")
        old.state, old.vector_space = State.READY, "r1"
        assert fleet.resolve("m", "r1").name == "m@r1", "a region a flip ahead asks for the old space"
        assert fleet.resolve("m", "r2").name == "m" and fleet.resolve("m").name == "m"
    scenario(test)


def test_a_declared_space_keeps_off_replicas_that_say_another():
    async def test(fleet: Fleet):
        rs = {r.url: r for r in fleet.upstreams.replicas("m")}
        rs[A].state, rs[A].vector_space = State.READY, "r1"
        rs[B].state = State.READY  # not heard from yet: tried, the pin rides on the request
        d = fleet.resolve("m")
        assert d.vector_space == "r2"
        for _ in range(20):
            ticket = fleet.begin(d)
            assert await fleet.acquire(d, ticket, None) is rs[B]
    scenario(test, vector_spaces={"m": "r2"})
