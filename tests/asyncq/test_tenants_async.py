"""Async jobs belong to their tenant: only it reads them, its quota paces them, nothing is failed for it.

A real server with a real Redis and `--api-keys`: one tenant's job id is not found for another
tenant, and a tenant over its tokens-per-minute quota has its jobs sent back to the queue (retried,
never `failed`) until the quota refills.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.asyncq.procs import start_redis, wait_for
from tests.procs import start_runtime

KEY_A = "sk-async-tenant-a-000000001"
KEY_B = "sk-async-tenant-b-000000001"
PASSAGE = " ".join(f"word{i}" for i in range(60))  # 122 tokens


@pytest.fixture
def stack(tmp_path: Path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"""
tenants:
  - name: alpha
    keys: ["{KEY_A}"]
    tokens_per_minute: 600
  - name: beta
    keys: ["{KEY_B}"]
    priority: batch
""")
    redis_server = start_redis(appendonly=False)
    srv = start_runtime("--redis-url", redis_server.url, "--api-keys", str(keys))
    yield srv
    srv.stop()
    redis_server.stop()


def client(srv, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=60, headers={"authorization": f"Bearer {key}"})


def test_jobs_are_read_only_by_their_tenant_and_paced_by_its_quota(stack):
    srv = stack
    with client(srv, KEY_A) as alpha, client(srv, KEY_B) as beta:
        ids = []
        for i in range(3):  # 3 x 2 x 122 = 732 tokens: over a minute's 600, so the last waits for the refill
            accepted = alpha.post("/async/v1/embeddings", json={"input": [f"{PASSAGE} {i}", f"{PASSAGE} {i}b"]})
            assert accepted.status_code == 202, accepted.text
            ids.append(accepted.json()["id"])
        theirs = beta.get(f"/async/jobs/{ids[0]}")
        assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "job_not_found", \
            "another tenant cannot tell the job exists"
        whole = alpha.post("/async/v1/embeddings", json={"input": [PASSAGE] * 6})
        assert whole.status_code == 413 and whole.json()["error"]["code"] == "over_quota", \
            "a job that can never fit the quota is refused at submission, not failed later"

        docs: dict[str, dict] = {}

        def all_done() -> bool:
            for job_id in ids:
                docs[job_id] = alpha.get(f"/async/jobs/{job_id}").json()
                assert docs[job_id]["status"] != "failed", docs[job_id]
            return all(d["status"] == "succeeded" for d in docs.values())

        wait_for(all_done, 180, "alpha's jobs")
    assert sum(d.get("retries", 0) for d in docs.values()) >= 1, "the quota sent a job back to wait"
    assert any("quota" in d.get("retry_reason", "") for d in docs.values())
    assert srv.metric("embedfleet_tenant_tokens_total", tenant="alpha") == pytest.approx(6 * 122, abs=12)
