"""Spill on queue length (gateway/spill.py `should_spill_queue`): a region whose replicas are all over the
bound sends the request to another region the policy allows instead of queueing it, or refusing it,
here; with nowhere to go it sheds as before.

Two gateways stand for two regions, each in front of a stand-in runtime reporting a chosen load: `us`
(replica `a`, may spill to `eu`) and `eu` (replica `b`, idle). `locked` fronts the same replica `a` with
no spill target (RegionLocked). Bounds are the defaults: --spill-after 2, --max-queue-seconds 5,
--max-queue-seconds-bulk 30.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest

from embedfleet.gateway.bounds import Bounds
from embedfleet.gateway.config import GatewayConfig
from embedfleet.gateway.fleet import Fleet
from embedfleet.gateway.pick import State
from embedfleet.gateway.spill import SPILLED_FROM, Target
from tests.gateway.conftest import GatewayServer, StubRuntime, start_gateway, start_stub, wait_for

SPILLED = "embedfleet_gateway_spilled_total"


@pytest.fixture(scope="module")
def regions():
    a, b = start_stub("--model", "m", "--name", "a"), start_stub("--model", "m", "--name", "b")
    eu = start_gateway("--region", "eu", "--upstream", f"m={b.url}", "--poll-interval", "0.1")
    us = start_gateway("--region", "us", "--upstream", f"m={a.url}", "--spill", f"m=eu={eu.url}",
                       "--poll-interval", "0.1")
    locked = start_gateway("--region", "us", "--upstream", f"m={a.url}", "--poll-interval", "0.1")
    yield us, eu, locked, a, b
    for proc in (us, locked, eu, a, b):
        proc.stop()


def load(replica: StubRuntime, gateways: tuple[GatewayServer, ...], status: str, wait: float) -> None:
    """Set what `replica` reports, and wait until every gateway has polled it (each step uses a wait of its
    own: the state comes in the same poll as the wait)."""
    replica.control(status=status, expected_wait=wait)
    wait_for(lambda: all(gw.count("embedfleet_gateway_replica_expected_wait_seconds", deployment="m",
                                  replica=replica.url) == wait for gw in gateways),
             f"the gateways to see {replica.url} report {wait}s ({status})")


def embed(gateway: GatewayServer, tag: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "m", "input": "q", "tag": tag},
                      headers=headers, timeout=30)


def tags(replica: StubRuntime) -> list[str]:
    return [entry["tag"] for entry in replica.received()]


def test_queries_spill_when_every_replica_here_is_saturated_and_over_the_bound(regions):
    us, eu, locked, a, b = regions
    load(a, (us, locked), "saturated", 12.0)
    answers = [embed(us, f"busy-{i}") for i in range(3)]
    assert [(r.status_code, r.json()["served_by"]) for r in answers] == [(200, "b")] * 3
    assert {"busy-0", "busy-1", "busy-2"} <= set(tags(b)) and not {"busy-0", "busy-1", "busy-2"} & set(tags(a))
    assert us.count(SPILLED, deployment="m", to="eu", reason="queue") == 3
    assert us.count(SPILLED, deployment="m", to="eu", reason="cold") == 0
    assert eu.count("embedfleet_gateway_requests_total", deployment="m", code="200") >= 3
    assert us.count("embedfleet_gateway_shed_total", deployment="m") == 0  # spilled, never shed

    # without a target: shed as before (ceil(12 - 5) = 7 s until the replica is back under the bound)
    refused = embed(locked, "locked-busy")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded", refused.text
    assert refused.headers["retry-after"] == "7"
    assert "locked-busy" not in tags(a) + tags(b)
    assert locked.count(SPILLED, deployment="m") == 0


def test_a_query_leaves_past_the_spill_threshold_where_it_would_still_queue_unspilled(regions):
    us, _, locked, a, b = regions
    load(a, (us, locked), "saturated", 3.0)  # over --spill-after (2), under --max-queue-seconds (5)
    spilled, kept = embed(us, "three-us"), embed(locked, "three-locked")
    assert (spilled.status_code, spilled.json()["served_by"]) == (200, "b")
    assert (kept.status_code, kept.json()["served_by"]) == (200, "a")  # nowhere to go: it queues here
    assert "three-us" in tags(b) and "three-locked" in tags(a)


def test_bulk_work_is_judged_by_the_bulk_bound(regions):
    us, _, locked, a, b = regions
    before = us.count(SPILLED, deployment="m", to="eu", reason="queue")
    load(a, (us,), "ready", 10.0)  # a backfill: long queue, still taking queries
    query, bulk = embed(us, "q-10"), embed(us, "bulk-10", **{"x-priority": "bulk"})
    assert [r.json()["served_by"] for r in (query, bulk)] == ["a", "a"]  # 10 s: under the bulk bound (30)
    load(a, (us, locked), "ready", 40.0)
    query, bulk = embed(us, "q-40"), embed(us, "bulk-40", **{"x-priority": "bulk"})
    assert (query.status_code, query.json()["served_by"]) == (200, "a")  # queries jump the backfill
    assert (bulk.status_code, bulk.json()["served_by"]) == (200, "b")  # 40 s: over the bulk bound, spilled
    assert us.count(SPILLED, deployment="m", to="eu", reason="queue") == before + 1
    assert "bulk-40" in tags(b) and {"q-10", "bulk-10", "q-40"} <= set(tags(a))
    shed = embed(locked, "bulk-40-locked", **{"x-priority": "bulk"})
    assert shed.status_code == 429 and "--max-queue-seconds-bulk" in shed.json()["error"]["message"]
    assert shed.headers["retry-after"] == "10"  # ceil(40 - 30)


def test_a_request_spilled_in_is_never_spilled_again(regions):
    us, _, _, a, b = regions
    load(a, (us,), "saturated", 15.0)
    shed_count = {"deployment": "m", "reason": "expected_wait"}
    before, shed = us.count(SPILLED, deployment="m"), us.count("embedfleet_gateway_shed_total", **shed_count)
    answer = embed(us, "from-ap", **{SPILLED_FROM: "ap"})
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "overloaded", answer.text
    assert answer.headers["retry-after"] == "10"  # ceil(15 - 5): refused here, as without a target
    assert "from-ap" not in tags(a) + tags(b)
    assert us.count(SPILLED, deployment="m") == before
    assert us.count("embedfleet_gateway_shed_total", **shed_count) == shed + 1


def test_a_deployments_own_spill_after_sets_when_its_queries_leave():
    """Kubernetes mode: spec.placement.spillAfterSeconds is that deployment's threshold (kube.py ->
    set_routes); one without it goes by --spill-after."""
    routes = {"eager": ("team/eager", ["http://198.18.0.5:8080"]),
              "patient": ("team/patient", ["http://198.18.0.6:8080"])}
    target = "http://198.18.9.9:8000"

    async def run() -> dict[str, tuple[str, str]]:
        async with aiohttp.ClientSession() as polls:  # never used: nothing here polls
            fleet = Fleet(GatewayConfig(spill_after=4.0, max_queue_seconds=5.0), polls)
            fleet.set_routes(routes, {}, {"team/eager": Bounds(spill_after_s=1.0)})
            out = {}
            for key in ("team/eager", "team/patient"):
                fleet.set_spill(key, [Target("eu", target)])
                (replica,) = fleet.upstreams.replicas(key)
                replica.state, replica.reported_wait_s = State.BUSY, 2.5  # saturated, 2.5 s queued
                deployment = fleet.deployments[key]
                ticket = fleet.begin(deployment)
                got = await fleet.acquire(deployment, ticket, None)
                out[key] = (got.url, ticket.spill_reason)
            return out

    assert asyncio.run(run()) == {"team/eager": (target, "queue"), "team/patient": ("http://198.18.0.6:8080", "")}


def test_a_region_that_cannot_take_a_spilled_request_passes_it_to_the_next_and_is_skipped_for_a_while():
    """`home` (replica h, saturated) may spill to `ap` first, then `eu` (the hub's order). ap's only replica
    is saturated far past ap's bound, so ap's gateway sheds what home spills to it (429 overloaded): the
    request ran nowhere, and goes on to eu, which answers. The next request skips ap (marked down) and goes
    straight to eu. With neither left (eu's replica saturated too, ap still skipped), home sheds as it would
    with no target."""
    h, c, e = (start_stub("--model", "m", "--name", name) for name in ("h", "c", "e"))
    procs = [h, c, e]
    try:
        ap = start_gateway("--region", "ap", "--upstream", f"m={c.url}", "--poll-interval", "0.1")
        procs.append(ap)
        eu = start_gateway("--region", "eu", "--upstream", f"m={e.url}", "--poll-interval", "0.1")
        procs.append(eu)
        home = start_gateway("--region", "home", "--upstream", f"m={h.url}", "--poll-interval", "0.1",
                             "--spill", f"m=ap={ap.url}", "--spill", f"m=eu={eu.url}")
        procs.append(home)
        load(h, (home,), "saturated", 12.0)
        load(c, (ap,), "saturated", 20.0)

        first = embed(home, "first")
        assert (first.status_code, first.json()["served_by"]) == (200, "e"), first.text
        assert ap.count("embedfleet_gateway_shed_total", deployment="m", reason="expected_wait") == 1
        assert home.count("embedfleet_gateway_retries_total", deployment="m", reason="spill_refused") == 1
        assert home.count(SPILLED, deployment="m", to="eu", reason="queue") == 1
        assert home.count(SPILLED, deployment="m", to="ap") == 0  # refused there: not counted as spilled
        assert "first" in tags(e) and "first" not in tags(c) + tags(h)

        second = embed(home, "second")
        assert (second.status_code, second.json()["served_by"]) == (200, "e")
        assert ap.count("embedfleet_gateway_shed_total", deployment="m", reason="expected_wait") == 1  # skipped
        assert home.count("embedfleet_gateway_retries_total", deployment="m", reason="spill_refused") == 1

        load(e, (eu,), "saturated", 20.0)
        third = embed(home, "third")
        assert third.status_code == 429 and third.json()["error"]["code"] == "overloaded", third.text
        assert "--max-queue-seconds" in third.json()["error"]["message"]  # home's own refusal, not eu's
        assert "third" not in tags(c) + tags(e) + tags(h)
        assert home.count("embedfleet_gateway_shed_total", deployment="m", reason="expected_wait") == 1
    finally:
        for proc in reversed(procs):
            proc.stop()
