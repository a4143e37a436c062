"""What a job of each kind does, and the request body each kind accepts.

A job's result is exactly the body its sync route would have answered, so a client can switch
between `/v1/embeddings` and `/async/v1/embeddings` without a second parser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from pydantic import BaseModel, Field

from embedfleet.runtime.api.bodies import classify_body, embeddings_body, rerank_body
from embedfleet.runtime.api.prepare import prepare_classify, prepare_embedding, prepare_rerank, select
from embedfleet.runtime.api.schemas import ClassifyRequest, OpenAIEmbeddingRequest, RerankRequest
from embedfleet.runtime.core.quantize import needs_ranges
from embedfleet.runtime.service import Models, ModelService
from embedfleet.runtime.tenants import Tenant

WEBHOOK = Field(None, description="POSTed the finished job (signed, see docs/async.md); http(s) only")


class AsyncEmbeddingRequest(OpenAIEmbeddingRequest):
    webhook_url: str | None = WEBHOOK


class AsyncRerankRequest(RerankRequest):
    webhook_url: str | None = WEBHOOK


class AsyncClassifyRequest(ClassifyRequest):
    webhook_url: str | None = WEBHOOK


class JobFailed(Exception):
    """A permanent failure: running the job again would fail the same way."""


async def run_embeddings(models: Models, request: bytes, tenant: Tenant | None = None) -> bytes:
    """The sync route's own checks and body; async jobs yield to sync traffic (urgent=False) and run as
    their tenant (its quota and fair share)."""
    body = AsyncEmbeddingRequest.model_validate_json(request)
    svc = select(models, body.model, "/async/v1/embeddings")
    result = await svc.run(await prepare_embedding(svc, body, body.input), urgent=False, tenant=tenant)
    calibration = await svc.calibrated() if needs_ranges(body.encoding_format) else None
    return orjson.dumps(embeddings_body(svc.name, result.rows, result.tokens, body.dimensions, body.encoding_format,
                                        calibration),
                        option=orjson.OPT_SERIALIZE_NUMPY)


async def run_rerank(models: Models, request: bytes, tenant: Tenant | None = None) -> bytes:
    body = AsyncRerankRequest.model_validate_json(request)
    svc = select(models, body.model, "/async/rerank")
    result = await svc.run(await prepare_rerank(svc, body), urgent=False, tenant=tenant)
    return orjson.dumps(rerank_body(body, result.rows))


async def run_classify(models: Models, request: bytes, tenant: Tenant | None = None) -> bytes:
    body = AsyncClassifyRequest.model_validate_json(request)
    svc = select(models, body.model, "/async/classify")
    result = await svc.run(await prepare_classify(svc, body), urgent=False, tenant=tenant)
    return orjson.dumps(classify_body(svc, body, result.rows, result.tokens))


@dataclass(frozen=True)
class Kind:
    """One async job kind: its request body, the sync route whose checks it shares, how to run it."""

    request: type[BaseModel]
    route: str
    prepare: Callable[[ModelService, BaseModel], Awaitable[object]]
    run: Callable[[Models, bytes, Tenant | None], Awaitable[bytes]]


KINDS: dict[str, Kind] = {
    "embeddings": Kind(AsyncEmbeddingRequest, "/async/v1/embeddings",
                       lambda svc, body: prepare_embedding(svc, body, body.input), run_embeddings),
    "rerank": Kind(AsyncRerankRequest, "/async/rerank", prepare_rerank, run_rerank),
    "classify": Kind(AsyncClassifyRequest, "/async/classify", prepare_classify, run_classify),
}
