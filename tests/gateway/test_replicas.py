"""Between replicas of one deployment (stand-in runtimes that report a chosen load): the least
expected wait wins, a slow replica gets fewer requests, and a replica that did not take a request
(draining, gone) is skipped at once and the request answered by another."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from tests.gateway.conftest import wait_for


def served_by(gateway, n: int, **body) -> Counter:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        answers = [client.post("/v1/embeddings", json={"model": "m", "input": "x", **body}) for _ in range(n)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    return Counter(a.json()["served_by"] for a in answers)


def ready(gateway, n: int) -> None:
    wait_for(lambda: gateway.load()["m"]["ready_replicas"] == n, f"{n} replicas ready")


def test_the_replica_reporting_less_wait_gets_the_requests(gateway_factory, stub_factory):
    a = stub_factory("--model", "m", "--name", "a", "--expected-wait", "5")
    b = stub_factory("--model", "m", "--name", "b", "--expected-wait", "0")
    gateway = gateway_factory("--upstream", f"m={a.url}", "--upstream", f"m={b.url}", "--poll-interval", "0.1")
    ready(gateway, 2)
    assert served_by(gateway, 20) == {"b": 20}
    a.control(expected_wait=0)
    b.control(expected_wait=5)

    def flipped() -> bool:  # both replicas' new waits seen (one seen alone is a tie, decided at random)
        waits = {r: gateway.count("embedfleet_gateway_replica_expected_wait_seconds", deployment="m", replica=r)
                 for r in (a.url, b.url)}
        return waits[a.url] < 1 and waits[b.url] >= 4

    wait_for(flipped, "polls to report a's shorter wait and b's longer one")
    assert served_by(gateway, 20) == {"a": 20}


def test_a_slow_replica_gets_fewer_requests(gateway_factory, stub_factory):
    fast = stub_factory("--model", "m", "--name", "fast")
    slow = stub_factory("--model", "m", "--name", "slow", "--delay", "0.3")
    gateway = gateway_factory("--upstream", f"m={fast.url}", "--upstream", f"m={slow.url}")
    ready(gateway, 2)

    async def load() -> Counter:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            async def worker() -> list[str]:
                out = []
                for _ in range(10):
                    r = await client.post("/v1/embeddings", json={"model": "m", "input": "x"})
                    assert r.status_code == 200
                    out.append(r.json()["served_by"])
                return out
            return Counter(s for w in await asyncio.gather(*(worker() for _ in range(4))) for s in w)

    counts = asyncio.run(load())
    assert sum(counts.values()) == 40
    assert counts["slow"] < counts["fast"], counts


def test_a_draining_answer_sends_the_request_to_another_replica_at_once(gateway_factory, stub_factory):
    draining = stub_factory("--model", "m", "--name", "draining", "--expected-wait", "0")
    other = stub_factory("--model", "m", "--name", "other", "--expected-wait", "1")
    # polls far apart: only the 503 itself can tell the gateway
    gateway = gateway_factory("--upstream", f"m={draining.url}", "--upstream", f"m={other.url}",
                              "--poll-interval", "60")
    ready(gateway, 2)
    draining.control(draining=True)  # its /load still said ready when polled
    assert served_by(gateway, 5) == {"other": 5}
    assert [e["refused"] for e in draining.received()] == [True]  # tried once, never again
    assert gateway.load()["m"]["ready_replicas"] == 1
    assert gateway.count("embedfleet_gateway_retries_total", deployment="m", reason="draining") == 1


def test_a_replica_that_refuses_connections_is_skipped(gateway_factory, stub_factory):
    gone = stub_factory("--model", "m", "--name", "gone", "--expected-wait", "0")
    other = stub_factory("--model", "m", "--name", "other", "--expected-wait", "1")
    gateway = gateway_factory("--upstream", f"m={gone.url}", "--upstream", f"m={other.url}", "--poll-interval", "60")
    ready(gateway, 2)
    gone.stop()
    assert served_by(gateway, 5) == {"other": 5}
    assert gateway.load()["m"]["ready_replicas"] == 1
    assert gateway.count("embedfleet_gateway_retries_total", deployment="m", reason="connect") == 1


def test_a_saturated_replica_is_a_last_resort_never_a_reason_to_hold(gateway_factory, stub_factory):
    busy = stub_factory("--model", "m", "--name", "busy", "--expected-wait", "0")
    other = stub_factory("--model", "m", "--name", "other", "--expected-wait", "3")
    busy.control(status="saturated")  # its /ready is 503 for load: it still answers
    gateway = gateway_factory("--upstream", f"m={busy.url}", "--upstream", f"m={other.url}", "--poll-interval", "0.1")
    ready(gateway, 2)
    assert served_by(gateway, 10) == {"other": 10}  # a ready replica first, whatever it reports
    other.control(status="loading")
    ready(gateway, 1)
    assert served_by(gateway, 5) == {"busy": 5}
    assert gateway.load()["m"]["held"] == 0
