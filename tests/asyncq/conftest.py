"""Fixtures of the async tests: a fresh real redis-server per test (AOF on), worker processes."""

from __future__ import annotations

import pytest

from tests.asyncq.procs import RedisServer, WorkerProcess, start_redis, start_worker


@pytest.fixture
def redis_server() -> RedisServer:
    server = start_redis(appendonly=True)
    yield server
    server.stop()


@pytest.fixture
def worker_factory():
    started: list[WorkerProcess] = []

    def start(redis_url: str, *flags: str) -> WorkerProcess:
        worker = start_worker(redis_url, *flags)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
