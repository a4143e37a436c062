"""Outlier ejection: a replica failing requests in a row is left out for a back-off that doubles while
it keeps failing, then tried again; worked examples, invariants, then a stand-in runtime answering 500s."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.gateway.eject import Ejection, admitted, is_failure
from embedfleet.gateway.pick import ROUTABLE, State
from tests.gateway.conftest import wait_for


def test_which_answers_count_against_a_replica():
    assert [s for s in (200, 400, 404, 413, 429, 500, 502, 503, 504) if is_failure(s)] == [500, 502, 503]
    assert not is_failure(503, draining=True)


def test_ejected_after_n_failures_then_tried_again_with_a_doubling_back_off():
    e = Ejection()
    assert [e.failed(0.0, after=3, base_s=5, max_s=60) for _ in range(3)] == [False, False, True]
    assert e.ejected(4.9) and not e.ejected(5.0)
    assert not e.failed(2.0, after=3)  # an answer to a request sent before it was ejected
    # back, on probation: one more failure and it is out again, for twice as long
    assert e.failed(5.0, after=3, base_s=5, max_s=60) and e.until == 15.0
    assert e.failed(15.0, after=3, base_s=5, max_s=60) and e.until == 35.0
    assert e.failed(35.0, after=3, base_s=5, max_s=60) and e.until == 35.0 + 40.0
    assert e.failed(75.0, after=3, base_s=5, max_s=60) and e.until == 75.0 + 60.0  # capped
    e.succeeded()  # one success clears it all: the next ejection needs 3 failures and lasts 5 s
    assert [e.failed(200.0, after=3, base_s=5, max_s=60) for _ in range(3)] == [False, False, True]
    assert e.until == 205.0


@dataclass
class R:
    state: State = State.READY
    ejection: Ejection = field(default_factory=Ejection)


events = st.lists(st.tuples(st.floats(0, 30), st.booleans()), max_size=60)


@given(events, st.integers(1, 6), st.floats(0.1, 10), st.floats(10, 120))
def test_ejections_need_failures_in_a_row_and_never_last_past_the_cap(steps, after, base, cap):
    e, now, in_a_row, since_success = Ejection(), 0.0, 0, True
    for dt, ok in steps:
        now += dt
        if ok:
            e.succeeded()
            in_a_row, since_success = 0, True
            continue
        was_ejected = e.ejected(now)
        ejected = e.failed(now, after, base, cap)
        if not was_ejected:
            in_a_row += 1
        if ejected:
            assert not was_ejected
            # the first ejection after a success needs `after` failures in a row and lasts `base`
            if since_success:
                assert in_a_row >= after and e.until - now == pytest.approx(base)
            assert 0 < e.until - now <= max(cap, base) + 1e-9
            in_a_row, since_success = 0, False


@given(st.lists(st.tuples(st.sampled_from(list(State)), st.booleans()), max_size=8))
def test_admitted_leaves_out_ejected_replicas_unless_that_leaves_none_routable(spec):
    rs = [R(state, Ejection(until=10.0 if ejected else -1.0)) for state, ejected in spec]
    kept = admitted(rs, now=5.0)
    if any(r.state in ROUTABLE and not r.ejection.ejected(5.0) for r in rs):
        assert kept == [r for r in rs if not r.ejection.ejected(5.0)]
    else:
        assert kept == rs


def served(gateway, n: int) -> Counter:
    out = Counter()
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for _ in range(n):
            r = client.post("/v1/embeddings", json={"model": "m", "input": "x"})
            out[r.json()["served_by"] if r.status_code == 200 else r.status_code] += 1
    return out


def test_a_replica_answering_500s_is_ejected_then_tried_again(gateway_factory, stub_factory):
    bad = stub_factory("--model", "m", "--name", "bad", "--expected-wait", "0")
    good = stub_factory("--model", "m", "--name", "good", "--expected-wait", "1")  # so `bad` is picked first
    # ejections of 5 s, then 10: what is sent while one lasts takes a fraction of that even on a loaded machine
    gateway = gateway_factory("--upstream", f"m={bad.url}", "--upstream", f"m={good.url}", "--eject-after", "3",
                              "--eject-base", "5", "--poll-interval", "60")
    wait_for(lambda: gateway.load()["m"]["ready_replicas"] == 2, "both replicas ready")
    bad.control(fail_status=500)
    # its own answers pass through (a 500 may have run the request: never sent again), three in a row eject it
    assert served(gateway, 3) == {500: 3}
    assert gateway.count("embedfleet_gateway_ejections_total", deployment="m") == 1
    assert served(gateway, 10) == {"good": 10}
    assert gateway.load()["m"]["ready_replicas"] == 2  # ejected is not down: it is tried again later
    time.sleep(5.1)
    # back on probation: its first failure ejects it again, for twice as long
    assert served(gateway, 3) == {500: 1, "good": 2}
    assert gateway.count("embedfleet_gateway_ejections_total", deployment="m") == 2
    bad.control(fail_status=0)
    time.sleep(10.1)
    assert served(gateway, 1) == {"bad": 1}  # healthy again: picked first again
    assert len(bad.received()) == 5
