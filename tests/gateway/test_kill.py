"""A runtime killed (SIGKILL) under load while another replica is up: requests it had not started are
answered by the other one; those it was running are resent (embedding is idempotent) or end in a
clear 502, never a hang."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.gateway.conftest import MODEL, until, wait_for

BROKEN_OFF = {"upstream_disconnected", "upstream_broke_off", "bad_gateway", "upstream_unavailable"}


# The survivor takes the whole load at once; on a busy machine its expected wait may pass the default
# bound and it sheds with 429 (correct, and tested elsewhere). This test is about the kill, so both
# replicas queue without that bound.
PATIENT = ("--max-queue-seconds", "60", "--max-queue-seconds-bulk", "60")


def test_killing_a_runtime_mid_load_fails_nothing_it_had_not_started(gateway_factory, runtime_factory):
    victim = runtime_factory(*PATIENT)
    survivor = runtime_factory(*PATIENT)
    gateway = gateway_factory("--upstream", f"{MODEL}={victim.url}", "--upstream", f"{MODEL}={survivor.url}")
    wait_for(lambda: gateway.load()[MODEL]["ready_replicas"] == 2, "both replicas ready")
    texts = [f"passage {i} " + "words " * 40 for i in range(8)]
    clients = 4

    async def scenario() -> tuple[list[tuple[int, str | None, float]], int]:
        results: list[tuple[int, str | None, float]] = []  # status, error code, seconds
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            async def worker() -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    r = await client.post("/v1/embeddings", json={"model": MODEL, "input": texts})
                    code = None if r.status_code == 200 else r.json()["error"]["code"]
                    results.append((r.status_code, code, time.monotonic() - started))
                    assert r.status_code != 200 or len(r.json()["data"]) == len(texts)

            workers = [asyncio.create_task(worker()) for _ in range(clients)]
            await until(lambda: victim.metric("embedfleet_requests_in_flight") >= 1, "work on the victim")
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(30)
            killed_at = len(results)
            await until(lambda: gateway.load()[MODEL]["ready_replicas"] == 1, "the gateway to see it gone")
            await until(lambda: len(results) >= killed_at + 16, "requests after the kill")
            stop.set()
            await asyncio.gather(*workers)
        return results, killed_at

    results, killed_at = asyncio.run(scenario())
    failed = [(status, code) for status, code, _ in results if status != 200]
    # at most the requests in flight when it died (one per client), each a 502 naming what broke
    assert len(failed) <= clients, failed
    assert all(status == 502 and code in BROKEN_OFF for status, code in failed), failed
    assert all(status == 200 for status, _, _ in results[killed_at + clients:])  # none after the kill
    assert max(seconds for _, _, seconds in results) < 30  # nothing hung
    assert gateway.count("embedfleet_gateway_requests_total", deployment=MODEL, code="200") >= killed_at + 16 - clients
    assert httpx.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": "after"}, timeout=60) \
        .status_code == 200
