"""The fleet in one process (no sockets): acquiring a replica, holding, releasing in arrival order."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from embedfleet.gateway.config import GatewayConfig
from embedfleet.gateway.errors import Refused
from embedfleet.gateway.fleet import Fleet
from embedfleet.gateway.pick import State

A, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002"


def scenario(test, **config):
    async def run():
        async with aiohttp.ClientSession() as polls:  # never used: nothing here polls
            fleet = Fleet(GatewayConfig(upstreams={"m": [A, B]}, **config), polls, random.Random(0))
            return await test(fleet)
    return asyncio.run(run())


def replicas(fleet: Fleet) -> dict:
    return {r.url: r for r in fleet.upstreams.replicas("m")}


async def held(fleet: Fleet, n: int) -> None:
    while len(fleet.deployments["m"].held) < n:
        await asyncio.sleep(0)


def test_a_ready_replica_is_taken_at_once_and_counted_in_flight():
    async def test(fleet: Fleet):
        rs = replicas(fleet)
        rs[A].state = State.READY
        d = fleet.resolve("m")
        got = await fleet.acquire(d, fleet.begin(d), None)
        assert got is rs[A] and rs[A].in_flight == 1 and d.in_flight == 1
        fleet.done(got)
        fleet.end(d)
        assert rs[A].in_flight == 0 and d.in_flight == 0 and fleet.snapshot()["m"]["last_request_age_s"] is not None
    scenario(test)


def test_held_requests_go_out_oldest_first_spread_over_the_ready_replicas():
    async def test(fleet: Fleet):
        d = fleet.resolve(None)  # the only deployment
        order: list[int] = []

        async def one(i: int):
            ticket = fleet.begin(d)
            replica = await fleet.acquire(d, ticket, None)
            order.append(i)
            return replica

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(one(i)))
            await held(fleet, i + 1)
        snap = fleet.snapshot()["m"]
        assert snap["held"] == 5 and snap["in_flight"] == 5 and snap["ready_replicas"] == 0
        for r in replicas(fleet).values():
            r.state = State.READY
        fleet.upstreams.on_change("m")  # what a poll that sees them ready does
        got = await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3, 4]
        assert sorted(sum(r is x for r in got) for x in replicas(fleet).values()) == [2, 3]
        assert len(d.held) == 0 and d.cold.observations == 1
    scenario(test)


def test_past_the_bound_is_refused_with_the_expected_cold_start():
    async def test(fleet: Fleet):
        d = fleet.resolve("m")
        first = asyncio.create_task(fleet.acquire(d, fleet.begin(d), None))
        await held(fleet, 1)
        with pytest.raises(Refused) as refused:
            await fleet.acquire(d, fleet.begin(d), None)
        assert (refused.value.status, refused.value.code) == (503, "hold_full")
        assert 1 <= refused.value.retry_after <= 7
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(d.held) == 0  # a client that left is no longer held
    scenario(test, max_held=1, cold_start_default=7)


def test_hold_timeout_and_deadline():
    async def test(fleet: Fleet):
        d = fleet.resolve("m")
        with pytest.raises(Refused) as refused:
            await fleet.acquire(d, fleet.begin(d), None)
        assert (refused.value.status, refused.value.code) == (503, "cold_start") and refused.value.retry_after >= 1
        with pytest.raises(Refused) as refused:
            await fleet.acquire(d, fleet.begin(d), fleet.now() + 0.01)
        assert (refused.value.status, refused.value.code) == (504, "deadline_exceeded")
        assert len(d.held) == 0
    scenario(test, hold_timeout=0.05)


def test_unknown_and_missing_models():
    async def test(fleet: Fleet):
        fleet.set_replicas("other", [])
        with pytest.raises(Refused) as refused:
            fleet.resolve("nope")
        assert refused.value.status == 404 and "['m', 'other']" in refused.value.message
        with pytest.raises(Refused) as refused:
            fleet.resolve(None)
        assert (refused.value.status, refused.value.code) == (400, "model_required")
        assert fleet.snapshot()["other"] == {"in_flight": 0, "held": 0, "ready_replicas": 0, "replicas": 0,
                                             "last_request_age_s": None, "expected_cold_start_s": 30.0}
    scenario(test)


def test_set_replicas_keeps_what_it_knows_of_a_replica():
    async def test(fleet: Fleet):
        rs = replicas(fleet)
        rs[A].state = State.READY
        rs[A].in_flight = 3
        fleet.set_replicas("m", [A + "/", "http://127.0.0.1:9003"])
        now = replicas(fleet)
        assert set(now) == {A, "http://127.0.0.1:9003"} and now[A] is rs[A]
        assert now["http://127.0.0.1:9003"].state is State.DOWN
    scenario(test)


def test_kubernetes_routes_map_models_to_deployments_and_forget_the_gone():
    """kube.py feeds `set_routes`: requests name the served model; the deployment is `<ns>/<name>`, the key
    the operator asks about; a deployment that left the cluster is forgotten."""
    fleet = Fleet(GatewayConfig(kubernetes=True), poll_session=None, rng=random.Random(0))  # type: ignore[arg-type]
    fleet.set_routes({"bge": ("team-a/bge-large", ["http://198.18.0.5:8080"]), "minilm": ("team-b/minilm", [])})
    assert fleet.resolve("bge").name == "team-a/bge-large"
    assert fleet.resolve("minilm").name == "team-b/minilm"
    with pytest.raises(Refused) as unknown:
        fleet.resolve("team-a/bge-large")  # the deployment's key is not a model name
    assert unknown.value.status == 404 and "['bge', 'minilm']" in str(unknown.value)
    fleet.set_routes({"bge": ("team-a/bge-large", [])})
    assert set(fleet.deployments) == {"team-a/bge-large"}
    assert "team-b/minilm" not in fleet.upstreams.deployments
