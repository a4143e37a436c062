"""Cold start: with no replica ready, requests are held (bounded in number and time), reported to
the autoscaler as held and in flight, and released in arrival order the moment a replica is ready."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np

from tests.gateway.conftest import MODEL, start_stub, until, wait_for
from tests.procs import free_port, stop_process


def held(gateway, deployment: str) -> int:
    return gateway.load()[deployment]["held"]


def test_held_requests_are_answered_once_the_runtime_starts(gateway_factory, runtime_factory, server):
    port = free_port()
    gateway = gateway_factory("--upstream", f"{MODEL}=http://127.0.0.1:{port}", "--hold-timeout", "300")
    texts = [f"held request number {i}" for i in range(3)]

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=300) as client:
            tasks = []
            for i, text in enumerate(texts):
                tasks.append(asyncio.create_task(client.post("/v1/embeddings", json={"model": MODEL, "input": text})))
                await until(lambda i=i: held(gateway, MODEL) == i + 1, f"{i + 1} requests held")
            load = gateway.load()[MODEL]
            assert load == {**load, "held": 3, "in_flight": 3, "ready_replicas": 0, "replicas": 1}
            assert gateway.count("embedfleet_gateway_held_requests", deployment=MODEL) == 3
            assert gateway.count("embedfleet_gateway_requests_in_flight", deployment=MODEL) == 3
            # now the runtime comes up on the address the gateway was given
            runtime = runtime_factory("--port", str(port), wait_ready=False)
            runtime.port = port
            return await asyncio.gather(*tasks)

    answers = asyncio.run(scenario())
    direct = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": texts}, timeout=60).json()
    for answer, row in zip(answers, direct["data"], strict=True):
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["data"][0]["embedding"], row["embedding"], atol=1e-5)
    load = gateway.load()[MODEL]
    assert load["held"] == load["in_flight"] == 0 and load["ready_replicas"] == 1
    assert load["expected_cold_start_s"] != 30.0  # learned from this one
    assert gateway.count("embedfleet_gateway_cold_start_seconds_count", deployment=MODEL) == 3
    assert gateway.count("embedfleet_gateway_cold_start_seconds_sum", deployment=MODEL) > 0


def test_held_requests_reach_the_replica_in_arrival_order(gateway_factory):
    port = free_port()
    # one connection to the replica, so the order the gateway sends in is the order it arrives in
    gateway = gateway_factory("--upstream", f"m=http://127.0.0.1:{port}", "--max-connections-per-replica", "1")
    stub = None

    async def scenario() -> list[httpx.Response]:
        nonlocal stub
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            tasks = []
            for i in range(6):
                body = {"model": "m", "input": "x", "tag": i}
                tasks.append(asyncio.create_task(client.post("/v1/embeddings", json=body,
                                                             headers={"x-request-timeout": "100"})))
                await until(lambda i=i: held(gateway, "m") == i + 1, f"{i + 1} requests held")
            stub = start_stub("--model", "m", port=port)
            return await asyncio.gather(*tasks)

    try:
        answers = asyncio.run(scenario())
        assert [a.status_code for a in answers] == [200] * 6
        received = stub.received()
    finally:
        if stub is not None:
            stub.stop()
    assert [e["tag"] for e in received] == list(range(6))
    # the deadline sent down is what is left of the client's, less the time held
    left = [float(e["headers"]["x-request-timeout"]) for e in received]
    assert all(0 < t < 100 for t in left) and left == sorted(left)
    assert gateway.count("embedfleet_gateway_cold_start_seconds_count", deployment="m") == 6


def test_a_query_held_after_bulk_work_reaches_the_replica_first(gateway_factory):
    port = free_port()
    gateway = gateway_factory("--upstream", f"m=http://127.0.0.1:{port}", "--max-connections-per-replica", "1")
    sends = [  # (tag, body, headers): bulk by header, bulk by size (5 inputs > 4), then a query
        ("bulk-0", {"input": "x"}, {"x-priority": "bulk"}),
        ("bulk-1", {"input": ["p"] * 5}, {}),
        ("bulk-2", {"input": "x"}, {"x-priority": "bulk"}),
        ("query", {"input": "x"}, {}),
        ("bulk-3", {"input": ["p"] * 8}, {}),
    ]
    stub = None

    async def scenario() -> list[httpx.Response]:
        nonlocal stub
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            tasks = []
            for i, (tag, body, headers) in enumerate(sends):
                tasks.append(asyncio.create_task(client.post("/v1/embeddings", headers=headers,
                                                             json={"model": "m", "tag": tag, **body})))
                await until(lambda i=i: held(gateway, "m") == i + 1, f"{i + 1} requests held")
            stub = start_stub("--model", "m", port=port)
            return await asyncio.gather(*tasks)

    try:
        answers = asyncio.run(scenario())
        assert [a.status_code for a in answers] == [200] * len(sends)
        received = stub.received()
    finally:
        if stub is not None:
            stub.stop()
    assert [e["tag"] for e in received] == ["query", "bulk-0", "bulk-1", "bulk-2", "bulk-3"]


def test_beyond_the_bounds_requests_are_refused_with_retry_after(gateway_factory):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing ever listens here
    gateway = gateway_factory("--upstream", f"m={dead}", "--max-held", "2", "--hold-timeout", "3",
                              "--cold-start-default", "20")

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            first = [asyncio.create_task(client.post("/v1/embeddings", json={"model": "m", "input": str(i)}))
                     for i in range(2)]
            await until(lambda: held(gateway, "m") == 2, "2 requests held")
            full = await client.post("/v1/embeddings", json={"model": "m", "input": "one too many"})
            return await asyncio.gather(*first), full, None

    timed_out, full, _ = asyncio.run(scenario())
    assert full.status_code == 503 and full.json()["error"]["code"] == "hold_full"
    assert 1 <= int(full.headers["retry-after"]) <= 20
    for answer in timed_out:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "cold_start" and "--hold-timeout" in answer.json()["error"]["message"]
        assert 1 <= int(answer.headers["retry-after"]) <= 20
    load = gateway.load()["m"]
    assert load["held"] == load["in_flight"] == 0
    assert gateway.count("embedfleet_gateway_requests_total", deployment="m", code="503") == 3
    # a client's own deadline ends its hold sooner
    r = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": "m", "input": "x"},
                   headers={"x-request-timeout": "0.2"}, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    # and the gateway still answers
    assert httpx.get(f"{gateway.url}/ready", timeout=10).status_code == 200


def test_a_client_that_leaves_is_no_longer_held(gateway_factory):
    gateway = gateway_factory("--upstream", f"m=http://127.0.0.1:{free_port()}")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            task = asyncio.create_task(client.post("/v1/embeddings", json={"model": "m", "input": "x"}))
            await until(lambda: held(gateway, "m") == 1, "the request held")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    wait_for(lambda: gateway.load()["m"]["held"] == 0 == gateway.load()["m"]["in_flight"], "the hold to be dropped")


def test_sigterm_stops_the_gateway_cleanly(gateway_factory):
    gateway = gateway_factory("--upstream", f"m=http://127.0.0.1:{free_port()}")
    stop_process(gateway.proc)
    assert gateway.proc.returncode == 0


def test_a_client_that_leaves_mid_request_stops_counting(gateway_factory, stub_factory):
    """A client gone while its request is at a replica: the gateway abandons it (in flight drops to 0 long
    before the replica's answer, 30 s away, could end it)."""
    stub = stub_factory("--name", "slow", "--model", "m", "--delay", "30")
    gateway = gateway_factory("--upstream", f"m={stub.url}")
    wait_for(lambda: gateway.load()["m"]["ready_replicas"] == 1, "the replica ready")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            task = asyncio.create_task(client.post("/v1/embeddings", json={"model": "m", "input": "x"}))
            await until(lambda: gateway.load()["m"]["in_flight"] == 1, "the request at the replica")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    wait_for(lambda: gateway.load()["m"]["in_flight"] == 0, "the abandoned request no longer in flight", timeout=15)
    assert httpx.get(f"{gateway.url}/ready", timeout=10).status_code == 200
