"""Two deployments share one Redis without seeing each other: every key carries the deployment."""

from __future__ import annotations

import asyncio
import json
import time

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.asyncq.keys import JOB_GROUP, Keys, deployment_prefix
from embedfleet.runtime.asyncq.store import JobStore, connect, text
from tests.asyncq.procs import jobs_cli, wait_for

names = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3, unique=True)


@given(names, names)
def test_distinct_deployments_never_share_a_prefix(a: list[str], b: list[str]) -> None:
    pa, pb = deployment_prefix(a), deployment_prefix(b)
    assert (pa == pb) == (set(a) == set(b))
    if pa != pb:  # nor can one deployment's keys fall under the other's prefix
        assert not (pa + ":").startswith(pb + ":") and not (pb + ":").startswith(pa + ":")


def test_prefix_is_the_served_name_or_the_explicit_one() -> None:
    assert Keys.for_deployment(["all-MiniLM-L6-v2"]).jobs == "embedfleet:all-MiniLM-L6-v2:jobs"
    assert Keys.for_deployment(["b", "a"]).prefix == "embedfleet:a+b"
    assert Keys.for_deployment(["a+b"]).prefix == "embedfleet:a%2Bb"
    assert Keys.for_deployment(["x"], "embedfleet").jobs == "embedfleet:jobs"  # the older layout, on request


def test_two_stores_on_one_redis_see_only_their_own_jobs(redis_server) -> None:
    async def scenario() -> None:
        alpha = JobStore(connect(redis_server.url), Keys.for_deployment(["alpha"]))
        beta = JobStore(connect(redis_server.url), Keys.for_deployment(["beta"]))
        for store in (alpha, beta):
            await store.ensure_groups()
        job_id = await alpha.submit("embeddings", b'{"input": "x"}', None, max_depth=1)
        assert job_id is not None
        assert await beta.submit("embeddings", b'{"input": "y"}', None, max_depth=1) is not None  # own depth
        assert await beta.job(job_id) is None
        taken = await beta.read(beta.keys.jobs, JOB_GROUP, "b", 10, 100)
        assert [e.job_id for e in taken] != [job_id] and len(taken) == 1
        assert (await alpha.depth())[0] == 1 and (await beta.depth())[0] == 1
        mine = (await alpha.read(alpha.keys.jobs, JOB_GROUP, "a", 10, 100))[0]
        assert (await alpha.start(job_id, "a")).state == "run"
        assert await alpha.finish(mine, "succeeded", b"{}", ttl=60) == 1
        assert await alpha.stats() == {"succeeded": 1} and await beta.stats() == {}
        keys = [text(k) async for k in alpha.redis.scan_iter("*")]
        assert keys and all(k.startswith(("embedfleet:alpha:", "embedfleet:beta:")) for k in keys)
        await alpha.close()
        await beta.close()

    asyncio.run(scenario())


def test_two_servers_sharing_one_redis(redis_server, runtime_factory) -> None:
    """alpha takes jobs but runs no worker; beta's worker must never run them, nor beta answer for them."""
    alpha = runtime_factory("--redis-url", redis_server.url, "--served-model-name", "alpha", "--no-async-worker")
    beta = runtime_factory("--redis-url", redis_server.url, "--served-model-name", "beta")
    with alpha.client() as a, beta.client() as b:
        job_a = a.post("/async/v1/embeddings", json={"input": "alpha's own"}).json()["id"]
        job_b = b.post("/async/v1/embeddings", json={"input": "beta's own"}).json()["id"]
        wait_for(lambda: b.get(f"/async/jobs/{job_b}").json()["status"] == "succeeded", 60, "beta's job")
        time.sleep(1.0)  # time enough for beta's worker to take alpha's job, if it could see it
        assert a.get(f"/async/jobs/{job_a}").json()["status"] == "queued"
        assert b.get(f"/async/jobs/{job_a}").status_code == 404
        assert a.get(f"/async/jobs/{job_b}").status_code == 404
    alpha_stats = json.loads(jobs_cli(redis_server.url, "stats", deployment="alpha").stdout)
    beta_stats = json.loads(jobs_cli(redis_server.url, "stats", deployment="beta").stdout)
    assert alpha_stats["queue_depth"] == 1 and "succeeded" not in alpha_stats
    assert beta_stats["queue_depth"] == 0 and beta_stats["succeeded"] == 1
    missing = jobs_cli(redis_server.url, "stats", deployment=None)
    assert missing.returncode == 2 and "--deployment" in missing.stderr
