"""HTTP face of the async path: submit a job (202), read a job; plus the lifespan that runs workers.

Submission runs the sync route's own checks (the same parsing from api/http.py and the same
`prepare` as the sync routers, so the two can never drift apart) including tokenization, so bad
input is refused with the same 4xx at once instead of being accepted and failing later. Only then
is the job stored; the 202 means it is in Redis.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from redis.exceptions import RedisError
from starlette.responses import Response

from embedfleet.runtime.api import errors
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, body_of, parse
from embedfleet.runtime.api.prepare import select
from embedfleet.runtime.asyncq.kinds import KINDS, AsyncClassifyRequest, AsyncEmbeddingRequest, AsyncRerankRequest
from embedfleet.runtime.asyncq.runner import AsyncRuntime
from embedfleet.runtime.asyncq.status import job_document
from embedfleet.runtime.asyncq.store import text
from embedfleet.runtime.asyncq.webhooks import WebhookRefused, check_webhook_url
from embedfleet.runtime.service import Models
from embedfleet.runtime.tenants import DEFAULT_TENANT, RequestOverQuota

log = logging.getLogger(__name__)


def store_unavailable(exc: RedisError) -> errors.ApiError:
    log.warning("job store unavailable: %s", exc)
    return errors.ApiError(503, "the job store (Redis) is unavailable; retry shortly", "store_unavailable",
                           {"retry-after": "2"})


def async_router(models: Models, jobs: bool = True) -> APIRouter:
    """The async routes (when --async-enabled) and, in their lifespan, worker + cache (when asked). `jobs`
    false (a split server's engines after the first): the embedding cache only, no routes and no worker."""
    settings = models.settings
    runtime = AsyncRuntime(models, run_worker=settings.async_worker and jobs)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    router = APIRouter(lifespan=lifespan, tags=["async"])
    if not settings.async_enabled or not jobs:
        return router

    async def submit(kind: str, request: Request):
        """Accept a request as a durable job after the sync route's own checks; the result is its body."""
        spec = KINDS[kind]
        body = await parse(request, spec.request, settings.max_client_batch_size)
        tenant = tenant_of(request.scope)
        svc = select(models, body.model, spec.route, tenant)
        tokenized = await spec.prepare(svc, body)  # refuses now what the worker would refuse later
        tokens = sum(len(t) for t in tokenized)
        if tenant.tokens_per_minute is not None and tokens > tenant.tokens_per_minute:
            # the quota only delays a job; one that can never fit it is refused now, not failed later
            raise errors.ApiError(413, str(RequestOverQuota(tenant.name, tokens, tenant.tokens_per_minute)),
                                  "over_quota")
        webhook_url = None
        if body.webhook_url is not None:
            if settings.webhook_secret is None:
                raise errors.ApiError(422, "webhook_url needs a signing secret on the server (--webhook-secret)",
                                      "webhooks_disabled")
            try:
                webhook_url = await check_webhook_url(body.webhook_url, settings.webhook_allow_private)
            except WebhookRefused as exc:
                raise errors.ApiError(422, str(exc), "invalid_webhook_url") from None
        stored = body.model_dump_json(exclude={"webhook_url"}).encode()
        try:
            job_id = await runtime.store.submit(kind, stored, webhook_url, settings.async_max_queue_depth,
                                                tenant=tenant.name)
        except RedisError as exc:
            raise store_unavailable(exc) from None
        if job_id is None:
            raise errors.ApiError(
                429, f"the async queue is full ({settings.async_max_queue_depth} unfinished jobs, "
                "--async-max-queue-depth); retry later", "queue_full", {"retry-after": str(runtime.retry_after())})
        location = f"/async/jobs/{job_id}"
        return JSON({"id": job_id, "object": "async_job", "status": "queued", "url": location}, status_code=202,
                    headers={"location": location})

    @router.post("/async/v1/embeddings", status_code=202, openapi_extra=body_of(AsyncEmbeddingRequest))
    async def submit_embeddings(request: Request):
        """An OpenAI embeddings request as a job; the result is exactly /v1/embeddings' body."""
        return await submit("embeddings", request)

    @router.post("/async/rerank", status_code=202, openapi_extra=body_of(AsyncRerankRequest))
    async def submit_rerank(request: Request):
        """A TEI-shaped rerank request as a job; the result is exactly /rerank's body."""
        return await submit("rerank", request)

    @router.post("/async/classify", status_code=202, openapi_extra=body_of(AsyncClassifyRequest))
    async def submit_classify(request: Request):
        """A classify request as a job; the result is exactly /classify's body."""
        return await submit("classify", request)

    @router.get("/async/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        """Status (queued, running, succeeded, failed) and, once succeeded, the result; only to the tenant
        that submitted the job (any other is told it does not exist)."""
        if not job_id.isalnum() or len(job_id) > 64:
            raise errors.ApiError(404, f"no job {job_id!r}", "job_not_found")
        try:
            fields = await runtime.store.job(job_id)
        except RedisError as exc:
            raise store_unavailable(exc) from None
        owner = text(fields.get("tenant", b"")) if fields else ""
        if fields is None or "status" not in fields or (owner or DEFAULT_TENANT) != tenant_of(request.scope).name:
            raise errors.ApiError(404, f"no job {job_id!r} (never submitted, or expired after "
                                  f"{settings.async_result_ttl}s)", "job_not_found")
        return Response(job_document(job_id, fields), media_type="application/json")

    return router
