"""Conditions of the replica, not of the request, on the sync routes: 429/503 with Retry-After, never 500.

A real uvicorn server on a loopback socket, the real default model and batch manager, with the engine
function made to fail the way a GPU does (CUDA out of memory) or the batcher refuses (queue full). The
async worker treats the same failures as transient (tests/asyncq/test_failures.py); both use one
definition of "out of memory" (core/oom.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

from embedfleet.runtime.api.app import create_app
from embedfleet.runtime.api.gate import GateState
from embedfleet.runtime.core.jobs import QueueFull
from embedfleet.runtime.core.oom import is_out_of_memory
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.service import Models
from embedfleet.runtime.settings import RuntimeSettings
from tests.procs import free_port, wait_url_ready


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Models]]:
    models = Models(RuntimeSettings(), RuntimeMetrics())
    port = free_port()
    config = uvicorn.Config(create_app(models, GateState()), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    if not wait_url_ready(url):
        pytest.fail("the server never became ready")
    yield url, models
    srv.should_exit = True
    thread.join(30)


def _embed(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"input": ["a sentence"]}, timeout=60)


@pytest.mark.parametrize(
    ("failure", "status", "code"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 503, "out_of_memory"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB"), 503,
         "out_of_memory"),
        (QueueFull("the batch queue is full", retry_after=2.2), 429, "overloaded"),
    ],
)
def test_replica_conditions_are_429_or_503_never_500(
    server: tuple[str, Models], failure: Exception, status: int, code: str
) -> None:
    url, models = server
    svc = next(iter(models.services.values()))
    real = svc.batcher.engine_fn

    def failing(batch):  # type: ignore[no-untyped-def]
        raise failure

    svc.batcher.engine_fn = failing
    try:
        answer = _embed(url)
    finally:
        svc.batcher.engine_fn = real
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code
    assert int(answer.headers["retry-after"]) >= (3 if status == 429 else 1)
    assert _embed(url).status_code == 200  # and it keeps serving


def test_a_bug_is_still_a_500(server: tuple[str, Models]) -> None:
    url, models = server
    svc = next(iter(models.services.values()))
    real = svc.batcher.engine_fn

    def broken(batch):  # type: ignore[no-untyped-def]
        raise ValueError("shapes do not match")

    svc.batcher.engine_fn = broken
    try:
        answer = _embed(url)
    finally:
        svc.batcher.engine_fn = real
    assert answer.status_code == 500 and "retry-after" not in answer.headers
    assert not is_out_of_memory(ValueError("shapes do not match"))
