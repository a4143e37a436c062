"""Tenants on a real server process: keys, allowed models, quotas, priorities and fair shares.

One `embedfleet serve --api-keys FILE` per test, the embedded all-MiniLM-L6-v2 on this machine's
CPU. Ordering, not wall-clock speed, is asserted: a query of an interactive tenant is answered while
a batch tenant's backfill is still running, and a second batch tenant's request finishes before the
first one's backlog does.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from embedfleet.runtime.settings import DEFAULT_MODEL_NAME

KEYS = {
    "search": "sk-search-00000000000000001",
    "backfill": "sk-backfill-000000000000001",
    "reports": "sk-reports-0000000000000001",
    "metered": "sk-metered-0000000000000001",
    "elsewhere": "sk-elsewhere-00000000000001",
}
PASSAGE = " ".join(f"word{i}" for i in range(60))  # ~120 tokens


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(f"""
tenants:
  - name: search
    keys: ["{KEYS['search']}"]
  - name: backfill
    keys: ["{KEYS['backfill']}"]
    priority: batch
  - name: reports
    keys: ["{KEYS['reports']}"]
    priority: batch
  - name: metered
    keys: ["{KEYS['metered']}"]
    tokens_per_minute: 600
  - name: elsewhere
    keys: ["{KEYS['elsewhere']}"]
    models: ["some-other-model"]
""")
    return path


def test_keys_models_and_per_tenant_metrics(runtime_factory, keys_file):
    srv = runtime_factory("--api-keys", str(keys_file))
    assert "names models this server does not serve: some-other-model" in srv.log()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        wrong = c.post("/v1/embeddings", json={"input": "x"}, headers={"authorization": "Bearer sk-nobody-1234567890"})
        assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200, "probes stay open"

        ok = c.post("/v1/embeddings", json={"input": "a query"}, headers=auth("search"))
        assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384
        refused = c.post("/v1/embeddings", json={"input": "a query"}, headers=auth("elsewhere"))
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "model_not_allowed"
        assert DEFAULT_MODEL_NAME in refused.json()["error"]["message"]
        assert c.get("/v1/models", headers=auth("search")).json()["data"][0]["id"] == DEFAULT_MODEL_NAME
        assert c.get("/v1/models", headers=auth("elsewhere")).json()["data"] == [], "a tenant sees its models only"
    assert srv.metric("embedfleet_tenant_requests_total", tenant="search") == 1
    assert srv.metric("embedfleet_tenant_tokens_total", tenant="search") >= 3
    assert srv.metric("embedfleet_tenant_refused_total", tenant="elsewhere", reason="model_not_allowed") == 1
    assert srv.metric("embedfleet_queue_wait_seconds_count", tenant="search") == 1
    for key in KEYS.values():
        assert key not in srv.log(), "keys are never logged"


def test_quota_is_429_with_retry_after_and_refills(runtime_factory, keys_file):
    srv = runtime_factory("--api-keys", str(keys_file))
    body = {"input": PASSAGE}  # ~120 tokens; the metered tenant has 600 per minute (10 per second)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        statuses = []
        for _ in range(8):
            resp = c.post("/v1/embeddings", json=body, headers=auth("metered"))
            statuses.append(resp.status_code)
            if resp.status_code == 429:
                break
        assert statuses[:4] == [200] * 4 and statuses[-1] == 429, statuses
        error = resp.json()["error"]
        assert error["code"] == "quota_exceeded" and "600 tokens per minute" in error["message"]
        retry = int(resp.headers["retry-after"])
        assert 1 <= retry <= 60
        assert c.post("/v1/embeddings", json=body, headers=auth("search")).status_code == 200, \
            "another tenant is not held back by this one's quota"
        time.sleep(retry)
        assert c.post("/v1/embeddings", json=body, headers=auth("metered")).status_code == 200, \
            "after Retry-After the same request fits"
        whole = c.post("/v1/embeddings", json={"input": [PASSAGE] * 6}, headers=auth("metered"))
        assert whole.status_code == 413 and whole.json()["error"]["code"] == "over_quota", whole.text
    assert srv.metric("embedfleet_tenant_refused_total", tenant="metered", reason="quota") >= 1
    with pytest.raises(KeyError):  # no series at all: the other tenant was never refused
        srv.metric("embedfleet_tenant_refused_total", tenant="search")


def test_batch_tenant_backfill_yields_to_queries_and_shares_with_other_batch_tenants(runtime_factory, keys_file):
    srv = runtime_factory("--api-keys", str(keys_file), "--max-batch-requests", "8",
                          "--max-queue-seconds-bulk", "300")  # a slow shared CI machine must not shed the backlog
    done: dict[str, list[float]] = {"backfill": [], "reports": [], "search": []}

    async def send(http: httpx.AsyncClient, tenant: str, inputs: list[str] | str) -> None:
        resp = await http.post("/v1/embeddings", json={"input": inputs}, headers=auth(tenant))
        assert resp.status_code == 200, (tenant, resp.text)
        done[tenant].append(time.monotonic())

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as http:
            backfill = [asyncio.create_task(send(http, "backfill", [f"{PASSAGE} {i} {k}" for k in range(48)]))
                        for i in range(6)]
            deadline = time.monotonic() + 120
            while srv.metric("embedfleet_queue_tokens") < 15_000:  # the backlog is queued
                assert time.monotonic() < deadline and not all(t.done() for t in backfill), "the backlog never queued"
                await asyncio.sleep(0.05)
            await send(http, "reports", [f"{PASSAGE} report {k}" for k in range(16)])
            await send(http, "search", "a query while the backfill runs")
            await asyncio.gather(*backfill)

    asyncio.run(scenario())
    last_backfill = max(done["backfill"])
    assert done["search"][0] < last_backfill, "the interactive query did not wait for the batch tenant's backlog"
    assert done["reports"][0] < last_backfill, "a second batch tenant took turns with the first one's backlog"
    waits = {t: srv.metric("embedfleet_queue_wait_seconds_count", tenant=t) for t in done}
    assert waits == {"backfill": 6, "reports": 1, "search": 1}
