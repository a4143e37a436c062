"""The start-up probe once the model serves (probe.on_engine_thread with `idle`): small batches, each run
only when the batch manager has no request's work, and never starved by steady traffic."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from embedfleet.runtime import probe


def chunks(n: int, size: int) -> list[int]:
    return [size] * (n // size) + ([n % size] if n % size else [])


def rows(batch: list) -> np.ndarray:
    return np.array([[float(len(x))] for x in batch])


def test_probe_batches_are_small_and_wait_for_the_engine_to_have_no_requests_work() -> None:
    busy = {"until": 0.0}
    ran: list[tuple[int, float]] = []

    def run(batch: list) -> np.ndarray:
        ran.append((len(batch), time.monotonic()))
        return rows(batch)

    async def scenario() -> np.ndarray:
        with ThreadPoolExecutor(1) as engine:
            execute = probe.on_engine_thread(run, engine, 64, 8192, idle=lambda: time.monotonic() >= busy["until"])
            busy["until"] = time.monotonic() + 0.3  # a request's work on the engine for the next 0.3 s
            started = time.monotonic()
            out = await execute([[1] * n for n in range(1, 21)])
            assert ran[0][1] - started >= 0.29, "the first probe batch waited for the request's work"
            return out

    out = asyncio.run(scenario())
    assert [n for n, _ in ran] == chunks(20, probe.YIELD_ROWS)
    assert out[:, 0].tolist() == [float(n) for n in range(1, 21)], "rows in input order"


def test_steady_traffic_cannot_starve_the_probe(monkeypatch) -> None:
    monkeypatch.setattr(probe, "YIELD_S", 0.2)
    ran: list[int] = []

    def run(batch: list) -> np.ndarray:
        ran.append(len(batch))
        return rows(batch)

    async def scenario() -> float:
        with ThreadPoolExecutor(1) as engine:
            execute = probe.on_engine_thread(run, engine, 64, 8192, idle=lambda: False)
            started = time.monotonic()
            await execute([[1, 2, 3]] * 10)
            return time.monotonic() - started

    took = asyncio.run(scenario())
    assert ran == chunks(10, probe.YIELD_ROWS)
    assert 0.2 * len(ran) - 0.01 <= took < 10.0, "each batch waited its bound, then ran"


def test_before_the_model_serves_batches_are_the_configured_limits() -> None:
    ran: list[int] = []

    def run(batch: list) -> np.ndarray:
        ran.append(len(batch))
        return rows(batch)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as engine:
            await probe.on_engine_thread(run, engine, 16, 8192)([[1, 2]] * 20)

    asyncio.run(scenario())
    assert ran == chunks(20, 16)


def startup(task: asyncio.Task | None, error: str | None = None) -> probe.StartupProbe:
    """A model's start-up probe in a given state (set by hand: no model)."""
    state = probe.StartupProbe("m")
    state._task, state.error = task, error
    return state


def test_reading_the_start_up_probe_while_it_runs_fails_or_is_stopped() -> None:
    from embedfleet.runtime.probe import ProbePending, ProbeUnavailable

    async def scenario() -> list[str]:
        seen = []
        running = asyncio.create_task(asyncio.sleep(60))
        try:
            await startup(running).wait(0.05)
        except ProbePending as exc:
            seen.append(f"pending: {exc}")
        reader = asyncio.create_task(startup(running).wait(30))
        await asyncio.sleep(0.05)
        running.cancel()  # the server closes while a reader waits: the reader is told, not cancelled
        try:
            await reader
        except ProbeUnavailable as exc:
            seen.append(f"stopped: {exc}")
        try:
            await startup(None, error="RuntimeError").wait(1)
        except ProbeUnavailable as exc:
            seen.append(f"failed: {exc}")
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 3, seen
    assert seen[0].startswith("pending: the start-up probe of m is still running")
    assert "shutting down" in seen[1]
    assert "(RuntimeError)" in seen[2] and "the model serves" in seen[2]
