"""Cross-region spill (gateway/spill.py): only where the policy names a region, never twice.

Two gateways stand for two regions: `us` fronts a real runtime; `eu` fronts the same deployment with
no replica up (a region at zero, or whose replicas are all down). `eu` with a spill target sends the
request to `us`; `eu` without one (RegionLocked: the policy names no other region) holds it and
answers 503 at its hold time-out, though it could have spilled; a request that was itself spilled
is never spilled again.
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.pick import ROUTABLE, State
from embedfleet.gateway.shed import decide
from embedfleet.gateway.spill import (
    DOWN_FOR_S,
    SPILLED_FROM,
    Target,
    choose,
    parse_annotation,
    queue_bound,
    refused_there,
    should_spill,
    should_spill_queue,
)
from tests.gateway.conftest import MODEL, start_gateway
from tests.gateway.test_shed import R
from tests.procs import free_port

# -- pure


@given(st.booleans(), st.booleans(), st.floats(0, 100), st.floats(0, 100), st.integers(0, 3))
def test_spill_only_with_somewhere_to_go_nothing_here_and_a_long_wait(routable, spilled_in, remaining, after, n):
    targets = [Target("us", f"http://198.18.0.{i}:8000") for i in range(n)]
    decision = should_spill(routable, spilled_in, remaining, after, targets)
    assert decision == (not routable and not spilled_in and n > 0 and remaining > after)




replica_sets = st.lists(st.builds(R, state=st.sampled_from(list(State)), reported_wait_s=st.floats(0, 120)),
                        max_size=6)
somewhere = [Target("us", "http://198.18.0.1:8000")]


def test_queue_spill_worked_examples():
    busy, backfilling = [R(State.BUSY, 12.0), R(State.BUSY, 9.0)], [R(State.READY, 40.0)]
    assert should_spill_queue(busy, 5.0, False, False, somewhere)
    assert not should_spill_queue(busy, 5.0, False, False, []), "no target: shed or queue here, as before"
    assert not should_spill_queue(busy, 5.0, False, True, somewhere), "spilled in: never again"
    assert not should_spill_queue([*busy, R(State.READY, 1.0)], 5.0, False, False, somewhere)
    assert not should_spill_queue(backfilling, 5.0, False, False, somewhere), "queries jump a backfill"
    assert should_spill_queue(backfilling, 30.0, True, False, somewhere), "bulk: by the reported wait alone"
    assert not should_spill_queue([R(State.DOWN, 50.0)], 5.0, True, False, somewhere), "none routable: cold rule"


def test_queue_bound_per_class():
    assert queue_bound(2.0, 5.0, bulk=False) == 2.0  # a query leaves past the spill threshold
    assert queue_bound(10.0, 5.0, bulk=False) == 5.0  # or where it would be shed, if that comes first
    assert queue_bound(10.0, 0.0, bulk=False) == 10.0  # shedding off: the spill threshold alone
    assert queue_bound(2.0, 30.0, bulk=True) == 30.0  # bulk is meant to queue: only what would be shed
    assert queue_bound(2.0, 0.0, bulk=True) == math.inf  # and never when nothing is shed


@given(replica_sets, st.floats(0, 60), st.booleans(), st.booleans(), st.integers(0, 2))
def test_queue_spill_exactly_when_every_routable_replica_is_over(rs, bound, bulk, spilled_in, n):
    targets = somewhere * n
    routable = [r for r in rs if r.state in ROUTABLE]
    over = [r.reported_wait_s > bound and (bulk or r.state is State.BUSY) for r in routable]
    assert should_spill_queue(rs, bound, bulk, spilled_in, targets) == (
        bool(routable) and all(over) and not spilled_in and n > 0)


@given(replica_sets, st.floats(0, 60), st.floats(0.1, 60), st.booleans())
def test_with_a_target_nothing_that_would_be_shed_stays_here(rs, after, shed_bound, bulk):
    """Spill is checked before shedding: where a target exists, every request the shed rule would
    refuse spills instead (its queue bound is never above the shed bound)."""
    if decide(rs, shed_bound, bulk) is not None:
        assert should_spill_queue(rs, queue_bound(after, shed_bound, bulk), bulk, False, somewhere)


@given(replica_sets, st.floats(0, 60), st.floats(0.1, 60))
def test_bulk_work_never_spills_for_a_wait_it_would_queue_for(rs, after, shed_bound):
    if should_spill_queue(rs, queue_bound(after, shed_bound, True), True, False, somewhere):
        assert decide(rs, shed_bound, True) is not None


def test_choose_skips_a_target_that_just_failed():
    first, second = Target("us", "http://a"), Target("ap", "http://b")
    assert choose([first, second], now=100.0) is first
    first.down_at = 95.0
    assert choose([first, second], now=100.0) is second
    second.down_at = 99.0
    assert choose([first, second], now=100.0) is None
    assert choose([first, second], now=95.0 + DOWN_FOR_S) is first


def test_a_malformed_annotation_spills_nowhere():
    good = '[{"cluster": "us-1", "region": "us-east-1", "url": "https://gw.us.example/"}]'
    assert [(t.region, t.url) for t in parse_annotation(good)] == [("us-east-1", "https://gw.us.example")]
    for bad in (None, "", "not json", "{}", '[{"region": "us"}]', '[{"region": "us", "url": "file:///etc"}]',
                '[1]', good[:-1]):
        assert parse_annotation(bad) == [], bad


# -- two regions, real processes


@pytest.fixture(scope="module")
def regions(server):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: eu has no replica that can take work
    us = start_gateway("--region", "us", "--upstream", f"{MODEL}={server.url}")
    eu = start_gateway("--region", "eu", "--upstream", f"{MODEL}={dead}", "--spill", f"{MODEL}=us={us.url}",
                       "--hold-timeout", "1")
    locked = start_gateway("--region", "eu", "--upstream", f"{MODEL}={dead}", "--hold-timeout", "1")
    yield us, eu, locked
    for gw in (us, eu, locked):
        gw.stop()


def test_a_region_with_no_replica_spills_where_the_policy_allows_and_counts_it(regions, server):
    us, eu, _ = regions
    body = {"model": MODEL, "input": ["spilled across regions"]}
    answer = httpx.post(f"{eu.url}/v1/embeddings", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    direct = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
    np.testing.assert_allclose(answer.json()["data"][0]["embedding"], direct["data"][0]["embedding"], atol=1e-5)
    assert eu.count("embedfleet_gateway_spilled_total", deployment=MODEL, to="us", reason="cold") == 1
    assert us.count("embedfleet_gateway_requests_total", deployment=MODEL, code="200") >= 1
    assert eu.load()[MODEL]["held"] == 0


def test_region_locked_never_spills_even_when_it_means_503(regions):
    _, _, locked = regions
    answer = httpx.post(f"{locked.url}/v1/embeddings", json={"model": MODEL, "input": "stay in eu"}, timeout=60)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "cold_start"
    assert int(answer.headers["retry-after"]) >= 1
    assert locked.count("embedfleet_gateway_spilled_total", deployment=MODEL, to="us") == 0


def test_a_spilled_request_is_never_spilled_again(regions):
    _, eu, _ = regions
    before = eu.count("embedfleet_gateway_spilled_total", deployment=MODEL, to="us")
    answer = httpx.post(f"{eu.url}/v1/embeddings", json={"model": MODEL, "input": "from ap"},
                        headers={SPILLED_FROM: "ap"}, timeout=60)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "cold_start"
    assert eu.count("embedfleet_gateway_spilled_total", deployment=MODEL, to="us") == before


@pytest.mark.parametrize(("status", "raw", "expected"), [
    (429, b'{"error":{"code":"overloaded","message":"m"}}', True),
    (503, b'{"error":{"code":"cold_start","message":"m"}}', True),
    (503, b'{"error":{"code":"hold_full","message":"m"}}', True),
    (503, b'{"error":{"code":"draining","message":"m"}}', True),
    (429, b'{"error":{"code":"quota_exceeded","message":"m"}}', False),  # the tenant's quota: the answer
    (503, b'{"error":{"code":"upstream_unavailable"}}', False),
    (500, b'{"error":{"code":"overloaded"}}', False),
    (200, b'{"data":[]}', False),
    (429, b"not json", False),
    (429, b"[1, 2]", False),
    (429, b'{"error":"overloaded"}', False),
])
def test_refused_there_only_for_answers_that_ran_nothing(status, raw, expected):
    assert refused_there(status, raw) is expected
