"""Accepted work is never lost: worker SIGKILLed mid-batch, Redis restarted, queue full."""

from __future__ import annotations

import asyncio

import httpx

from embedfleet.runtime.asyncq.keys import JOB_GROUP
from tests.asyncq.procs import KEYS, wait_for
from tests.procs import free_port


async def submit_many(url: str, bodies: list[dict], concurrency: int = 16) -> list[httpx.Response]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(body: dict) -> httpx.Response:
            async with limit:
                return await client.post("/async/v1/embeddings", json=body)

        return await asyncio.gather(*(one(b) for b in bodies))


def tiny_jobs(n: int) -> list[dict]:
    return [{"input": [f"job {i} text {j}" for j in range(1 + i % 4)]} for i in range(n)]


def test_worker_killed_mid_batch_every_job_succeeds_exactly_once(redis_server, runtime_factory, worker_factory):
    api = runtime_factory("--redis-url", redis_server.url, "--no-async-worker")
    n = 600  # enough that the kill lands with jobs claimed and unacknowledged (asserted below) and most still queued
    responses = asyncio.run(submit_many(api.url, tiny_jobs(n)))
    assert [r.status_code for r in responses] == [202] * n
    ids = [r.json()["id"] for r in responses]
    r = redis_server.client()
    assert r.zcard(KEYS.unfinished) == n

    first = worker_factory(redis_server.url, "--name", "first", "--async-visibility-timeout", "3",
                           "--async-worker-concurrency", "16")
    wait_for(lambda: int(r.hget(KEYS.stats, "succeeded") or 0) >= 150, 180, "the first worker to finish 150 jobs")
    first.kill()  # SIGKILL: no chance to acknowledge or clean up
    pending = r.xpending(KEYS.jobs, JOB_GROUP)
    assert pending["pending"] > 0 and {c["name"] for c in pending["consumers"]} == {b"first"}
    done_at_kill = int(r.hget(KEYS.stats, "succeeded"))
    assert done_at_kill < n

    worker_factory(redis_server.url, "--name", "second", "--async-visibility-timeout", "3")
    wait_for(lambda: r.zcard(KEYS.unfinished) == 0, 300, "every job to finish", interval=0.5)

    assert int(r.hget(KEYS.stats, "succeeded")) == n  # one result write per job, no more
    assert r.hget(KEYS.stats, "failed") is None
    assert r.xpending(KEYS.jobs, JOB_GROUP)["pending"] == 0
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(KEYS.job(job_id), "status", "result")
    rows = pipe.execute()
    assert all(status == b"succeeded" and result for status, result in rows)
    with api.client() as c:  # spot-check a job the killed worker may have held
        doc = c.get(f"/async/jobs/{ids[-1]}").json()
    assert doc["status"] == "succeeded" and len(doc["result"]["data"]) == 1 + (n - 1) % 4


def test_queued_jobs_survive_a_redis_restart_with_aof(redis_server, runtime_factory, worker_factory, tmp_path):
    api = runtime_factory("--redis-url", redis_server.url, "--no-async-worker")
    before = [r.json()["id"] for r in asyncio.run(submit_many(api.url, tiny_jobs(60)))]
    redis_server.restart()  # same directory: the append-only file is all that carries the jobs over
    r = redis_server.client()
    assert r.zcard(KEYS.unfinished) == 60 and r.xlen(KEYS.jobs) == 60
    again = asyncio.run(submit_many(api.url, tiny_jobs(5)))
    assert [x.status_code for x in again] == [202] * 5, (again[0].text, api.log()[-3000:])
    after = [x.json()["id"] for x in again]  # the replica reconnected
    metrics_port = free_port()
    worker_factory(redis_server.url, "--host", "127.0.0.1", "--metrics-port", str(metrics_port))
    wait_for(lambda: r.zcard(KEYS.unfinished) == 0, 180, "the queued jobs to finish")
    with api.client() as c:
        assert all(c.get(f"/async/jobs/{i}").json()["status"] == "succeeded" for i in before + after)
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text  # the worker's own
    assert "embedfleet_async_queue_depth" in metrics and "embedfleet_inputs_total" in metrics


def test_queue_full_is_429_and_nothing_accepted_is_lost(redis_server, runtime_factory, worker_factory):
    api = runtime_factory("--redis-url", redis_server.url, "--no-async-worker", "--async-max-queue-depth", "20")
    responses = asyncio.run(submit_many(api.url, tiny_jobs(30)))
    accepted = [r.json()["id"] for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code != 202]
    assert len(accepted) == 20 and len(refused) == 10
    assert all(r.status_code == 429 and int(r.headers["retry-after"]) >= 1 for r in refused)
    assert refused[0].json()["error"]["code"] == "queue_full"
    wait_for(lambda: api.metric("embedfleet_async_queue_depth") == 20, 10, "the depth gauge")
    assert api.metric("embedfleet_async_oldest_job_seconds") > 0

    worker_factory(redis_server.url)
    r = redis_server.client()
    wait_for(lambda: r.zcard(KEYS.unfinished) == 0, 180, "the accepted jobs to finish")
    with api.client() as c:
        assert all(c.get(f"/async/jobs/{i}").json()["status"] == "succeeded" for i in accepted)
        assert c.post("/async/v1/embeddings", json={"input": "room again"}).status_code == 202
