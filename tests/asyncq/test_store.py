"""The job store's atomic steps against a real Redis: one result per job, TTL, depth limit, webhook retry."""

from __future__ import annotations

import asyncio

from embedfleet.runtime.asyncq.keys import JOB_GROUP, WEBHOOK_GROUP
from embedfleet.runtime.asyncq.store import JobStore, connect


def test_second_finish_is_dropped_and_results_expire(redis_server) -> None:
    async def scenario() -> None:
        store = JobStore(connect(redis_server.url))
        await store.ensure_groups()
        job_id = await store.submit("embeddings", b'{"input": "x"}', "http://hook.example/x", max_depth=10)
        assert job_id is not None
        first = await store.read(store.keys.jobs, JOB_GROUP, "a", 10, 100)
        assert [e.job_id for e in first] == [job_id]
        assert (await store.start(job_id, "a")).state == "run"
        # worker "a" stalls; "b" takes the job over and both finish it
        stolen = await store.reclaim(store.keys.jobs, JOB_GROUP, "b", 0, 10)
        assert [e.job_id for e in stolen] == [job_id]
        assert (await store.start(job_id, "b")).attempts == 2
        assert await store.finish(stolen[0], "succeeded", b'{"n": 1}', ttl=1) == 1
        assert await store.finish(first[0], "succeeded", b'{"n": 2}', ttl=1) == 0
        job = await store.job(job_id)
        assert job["status"] == b"succeeded" and job["result"] == b'{"n": 1}'
        assert await store.stats() == {"succeeded": 1, "duplicates": 1}
        assert await store.depth() == (0, 0.0)
        assert (await store.redis.xpending(store.keys.jobs, JOB_GROUP))["pending"] == 0
        hooks = await store.read(store.keys.webhooks, WEBHOOK_GROUP, "s", 10, 100)
        assert [e.job_id for e in hooks] == [job_id]  # exactly one webhook for two finishes
        await asyncio.sleep(1.5)
        assert await store.job(job_id) is None  # expired after its TTL
        assert (await store.start(job_id, "c")).state == "gone"
        await store.close()

    asyncio.run(scenario())


def test_depth_limit_and_webhook_retry_schedule(redis_server) -> None:
    async def scenario() -> None:
        store = JobStore(connect(redis_server.url))
        await store.ensure_groups()
        ids = [await store.submit("embeddings", b"{}", None, max_depth=3) for _ in range(5)]
        assert sum(i is not None for i in ids) == 3 and ids[3] is None and ids[4] is None
        count, oldest = await store.depth()
        assert count == 3 and oldest >= 0
        await store.redis.xadd(store.keys.webhooks, {"id": ids[0], "attempt": 1})
        entry = (await store.read(store.keys.webhooks, WEBHOOK_GROUP, "s", 1, 100))[0]
        await store.retry_later(entry, delay=2.0, error="HTTP 500")
        assert await store.release_due() == 0  # not due yet
        await asyncio.sleep(2.1)
        assert await store.release_due() == 1
        again = await store.read(store.keys.webhooks, WEBHOOK_GROUP, "s", 1, 100)
        assert [(e.job_id, e.attempt) for e in again] == [(ids[0], 2)]
        await store.close()

    asyncio.run(scenario())
