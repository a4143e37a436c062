"""A runtime drained by SIGTERM while another replica is up: every request still succeeds."""

from __future__ import annotations

import asyncio
import signal

import httpx

from tests.gateway.conftest import MODEL, until, wait_for


def test_requests_keep_succeeding_while_a_replica_drains(gateway_factory, runtime_factory, server):
    leaving = runtime_factory("--drain-timeout", "60")
    # polls far apart, so the gateway learns of the drain from the answers themselves (503 draining,
    # then refused connections), the hard case; a poll would only have told it sooner
    gateway = gateway_factory("--upstream", f"{MODEL}={leaving.url}", "--upstream", f"{MODEL}={server.url}",
                              "--poll-interval", "60")
    wait_for(lambda: gateway.load()[MODEL]["ready_replicas"] == 2, "both replicas ready")
    texts = [f"passage {i} " + "words " * 30 for i in range(8)]

    async def scenario() -> list[int]:
        statuses: list[int] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            async def worker() -> None:
                while not stop.is_set():
                    r = await client.post("/v1/embeddings", json={"model": MODEL, "input": texts})
                    statuses.append(r.status_code)
                    assert r.status_code != 200 or len(r.json()["data"]) == 8

            workers = [asyncio.create_task(worker()) for _ in range(4)]
            await until(lambda: leaving.metric("embedfleet_requests_in_flight") >= 1, "work on the leaving replica")
            leaving.proc.send_signal(signal.SIGTERM)
            await until(lambda: leaving.proc.poll() is not None, "the drained replica to exit", within=120)
            await until(lambda: gateway.load()[MODEL]["ready_replicas"] == 1, "the gateway to drop it")
            served = len(statuses)
            await until(lambda: len(statuses) >= served + 8, "more requests after it left")
            stop.set()
            await asyncio.gather(*workers)
        return statuses

    statuses = asyncio.run(scenario())
    assert leaving.proc.returncode == 0  # it finished what it had accepted, then exited
    assert statuses and set(statuses) == {200}, statuses
    retried = sum(gateway.count("embedfleet_gateway_retries_total", deployment=MODEL, reason=reason)
                  for reason in ("draining", "connect"))
    assert retried >= 1
    assert gateway.count("embedfleet_gateway_requests_total", deployment=MODEL, code="200") == len(statuses)
