"""Shedding at the gateway: a request every replica would refuse for its expected wait is refused at
once (429 overloaded, Retry-After) instead of being sent down; worked examples, invariants, then the
gateway in front of stand-in runtimes reporting chosen waits."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import aiohttp
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.bounds import Bounds
from embedfleet.gateway.config import GatewayConfig
from embedfleet.gateway.errors import Refused
from embedfleet.gateway.fleet import Fleet
from embedfleet.gateway.pick import ROUTABLE, State
from embedfleet.gateway.shed import decide, over
from tests.gateway.conftest import wait_for


@dataclass
class R:
    state: State = State.READY
    reported_wait_s: float = 0.0
    in_flight: int = 0
    service_s: float = 0.01


def test_every_replica_over_the_bound_sheds_with_retry_after():
    shed = decide([R(State.BUSY, 12.0), R(State.BUSY, 9.2)], 5.0, bulk=False)
    assert shed is not None and shed.retry_after == 5 and shed.least_wait_s == 9.2  # ceil(9.2 - 5)
    assert decide([R(State.BUSY, 5.1)], 5.0, bulk=False).retry_after == 1  # at least 1


def test_one_replica_under_the_bound_takes_it():
    assert decide([R(State.BUSY, 12.0), R(State.READY, 1.0)], 5.0, bulk=False) is None


def test_a_backfilling_replica_still_takes_queries_but_not_more_bulk_work():
    # a long reported wait with the runtime still ready: queries jump ahead of its bulk queue
    backfilling = [R(State.READY, 40.0), R(State.READY, 35.0)]
    assert decide(backfilling, 5.0, bulk=False) is None
    assert decide(backfilling, 30.0, bulk=True).retry_after == 5


def test_nothing_routable_is_held_not_shed_and_zero_turns_shedding_off():
    assert decide([R(State.DOWN, 50.0), R(State.DRAINING, 50.0)], 5.0, bulk=True) is None
    assert decide([], 5.0, bulk=True) is None
    assert decide([R(State.BUSY, 50.0)], 0.0, bulk=False) is None


replicas = st.lists(st.builds(R, state=st.sampled_from(list(State)), reported_wait_s=st.floats(0, 120)), max_size=6)


@given(replicas, st.floats(0.1, 60), st.booleans())
def test_sheds_exactly_when_every_routable_replica_would_refuse(rs, bound, bulk):
    shed = decide(rs, bound, bulk)
    routable = [r for r in rs if r.state in ROUTABLE]
    assert (shed is not None) == (bool(routable) and all(over(r, bound, bulk) for r in routable))
    if shed is not None:
        least = min(r.reported_wait_s for r in routable)
        assert shed.retry_after >= 1 and shed.retry_after == max(1, math.ceil(least - bound))
        assert least - bound <= shed.retry_after  # by then the least-loaded one is expected under the bound


@given(replicas, st.floats(0.1, 60), st.floats(0, 60), st.booleans())
def test_a_higher_bound_never_sheds_more(rs, bound, more, bulk):
    if decide(rs, bound + more, bulk) is not None:
        assert decide(rs, bound, bulk) is not None


@given(replicas, st.floats(0.1, 60))
def test_a_query_is_shed_only_when_bulk_work_would_be_at_the_same_bound(rs, bound):
    if decide(rs, bound, bulk=False) is not None:
        assert decide(rs, bound, bulk=True) is not None


def test_the_gateway_sheds_when_every_replica_is_over_the_bound(gateway_factory, stub_factory):
    a = stub_factory("--model", "m", "--name", "a")
    b = stub_factory("--model", "m", "--name", "b")
    gateway = gateway_factory("--upstream", f"m={a.url}", "--upstream", f"m={b.url}", "--poll-interval", "0.1",
                              "--max-queue-seconds", "5")
    wait_for(lambda: gateway.load()["m"]["ready_replicas"] == 2, "both replicas ready")
    a.control(status="saturated", expected_wait=12.0)
    b.control(status="saturated", expected_wait=8.5)
    waits = {a.url: 12.0, b.url: 8.5}
    wait_for(lambda: all(gateway.count("embedfleet_gateway_replica_expected_wait_seconds", deployment="m",
                                       replica=url) == wait for url, wait in waits.items()),
             "the gateway to see both waits (per-replica metric)")
    r = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "m", "input": "q"}, timeout=30)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "overloaded" and "--max-queue-seconds" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "4"  # ceil(8.5 - 5): the least-loaded one's time back under the bound
    assert a.received() == b.received() == []  # never sent down
    assert gateway.count("embedfleet_gateway_shed_total", deployment="m", reason="expected_wait") == 1
    assert gateway.count("embedfleet_gateway_requests_total", deployment="m", code="429") == 1

    # one replica back under the bound: it takes the work
    b.control(status="ready", expected_wait=0.5)
    wait_for(lambda: httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "m", "input": "q"},
                                timeout=30).status_code == 200, "b to take queries again")


def test_static_bounds_shed_one_deployment_where_the_flag_would_not(gateway_factory, stub_factory):
    """`--bounds tight=maxQueueSeconds=2`: a replica of `tight` reporting 3.5 s sheds queries (the message
    names the flag that set the bound), while `loose`, with the same load and no bound of its own, goes by
    --max-queue-seconds 5 and takes them."""
    tight = stub_factory("--model", "tight", "--name", "t")
    loose = stub_factory("--model", "loose", "--name", "l")
    gateway = gateway_factory("--upstream", f"tight={tight.url}", "--upstream", f"loose={loose.url}",
                              "--poll-interval", "0.1", "--max-queue-seconds", "5",
                              "--bounds", "tight=maxQueueSeconds=2,maxQueueSecondsBulk=60")
    wait_for(lambda: gateway.load()["tight"]["ready_replicas"] == gateway.load()["loose"]["ready_replicas"] == 1,
             "both replicas ready")
    for stub in (tight, loose):
        stub.control(status="saturated", expected_wait=3.5)
    wait_for(lambda: all(gateway.count("embedfleet_gateway_replica_expected_wait_seconds", deployment=name,
                                       replica=stub.url) == 3.5 for name, stub in (("tight", tight), ("loose", loose))),
             "the gateway to see both waits")
    r = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "tight", "input": "q"}, timeout=30)
    assert r.status_code == 429, r.text
    assert "--bounds tight=maxQueueSeconds" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "2"  # ceil(3.5 - 2)
    assert tight.received() == []
    bulk = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "tight", "input": ["p"] * 32}, timeout=30)
    assert bulk.status_code == 200, bulk.text  # 3.5 s is under its own bulk bound of 60 s
    assert httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "loose", "input": "q"},
                      timeout=30).status_code == 200
    assert gateway.count("embedfleet_gateway_shed_total", deployment="tight", reason="expected_wait") == 1
    assert gateway.count("embedfleet_gateway_shed_total", deployment="loose", reason="expected_wait") == 0


def test_a_backfilling_fleet_takes_queries_and_sheds_bulk_work(gateway_factory, stub_factory):
    a = stub_factory("--model", "m", "--name", "a", "--expected-wait", "40")
    b = stub_factory("--model", "m", "--name", "b", "--expected-wait", "45")
    gateway = gateway_factory("--upstream", f"m={a.url}", "--upstream", f"m={b.url}", "--poll-interval", "0.1")
    wait_for(lambda: gateway.load()["m"]["ready_replicas"] == 2, "both replicas ready")
    query = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "m", "input": "q"}, timeout=30)
    assert query.status_code == 200 and query.json()["served_by"] == "a"
    marked = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "m", "input": "q"},
                        headers={"x-priority": "bulk"}, timeout=30)
    large = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "m", "input": ["p"] * 5}, timeout=30)
    for r in (marked, large):
        assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.text
        assert "--max-queue-seconds-bulk" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "10"  # ceil(40 - 30)
    assert gateway.count("embedfleet_gateway_shed_total", deployment="m", reason="expected_wait_bulk") == 2
    assert len(a.received()) == 1 and b.received() == []


def test_a_deployments_own_max_queue_seconds_sheds_where_the_flag_would_not():
    """Kubernetes mode: spec.runtime.maxQueueSeconds (kube.py -> set_routes) is that deployment's bound;
    another deployment with the same load and no bound of its own goes by --max-queue-seconds."""
    routes = {"tight": ("team/tight", ["http://198.18.0.5:8080"]), "loose": ("team/loose", ["http://198.18.0.6:8080"])}
    bounds = {"team/tight": Bounds(max_queue_s=2.0, max_queue_bulk_s=60.0)}

    async def run():
        async with aiohttp.ClientSession() as polls:  # never used: nothing here polls
            fleet = Fleet(GatewayConfig(max_queue_seconds=5.0, max_queue_seconds_bulk=30.0), polls)
            fleet.set_routes(routes, {}, bounds)
            for key in ("team/tight", "team/loose"):
                (replica,) = fleet.upstreams.replicas(key)
                replica.state, replica.reported_wait_s = State.BUSY, 3.5  # saturated, 3.5 s queued
            tight, loose = fleet.resolve("tight"), fleet.resolve("loose")
            with pytest.raises(Refused) as refused:
                await fleet.acquire(tight, fleet.begin(tight), None)
            got = await fleet.acquire(loose, fleet.begin(loose), None)  # 3.5 s is under the flag's 5 s
            bulk = fleet.begin(tight)
            bulk.bulk = True
            for_bulk = await fleet.acquire(tight, bulk, None)  # 3.5 s is under its own bulk bound
            return refused.value, got.url, for_bulk.url

    refused, loose_got, bulk_got = asyncio.run(run())
    assert (refused.status, refused.code, refused.retry_after) == (429, "overloaded", 2)  # ceil(3.5 - 2)
    assert "spec.runtime.maxQueueSeconds" in refused.message and "2s" in refused.message
    assert loose_got == "http://198.18.0.6:8080" and bulk_got == "http://198.18.0.5:8080"
