"""What a job of each kind does, and the request body each kind accepts.

A job's result is exactly the body its sync route would have answered, so a client can switch
between `/v1/embeddings` and `/async/v1/embeddings` without a second parser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from pydantic import Field

from embedfleet.runtime.api.prepare import prepare_embedding, select
from embedfleet.runtime.api.schemas import OpenAIEmbeddingRequest
from embedfleet.runtime.core.openai_body import embeddings_body
from embedfleet.runtime.service import Models


class AsyncEmbeddingRequest(OpenAIEmbeddingRequest):
    webhook_url: str | None = Field(
        None, description="POSTed the finished job (signed, see docs/async.md); http(s) only")


class JobFailed(Exception):
    """A permanent failure: running the job again would fail the same way."""


async def run_embeddings(models: Models, request: bytes) -> bytes:
    """The sync route's own checks and body; async jobs yield to sync traffic (urgent=False)."""
    body = AsyncEmbeddingRequest.model_validate_json(request)
    svc = select(models, body.model, "/v1/embeddings")
    result = await svc.run(await prepare_embedding(svc, body, body.input), urgent=False)
    return orjson.dumps(embeddings_body(svc.name, result.rows, result.tokens, body.dimensions, body.encoding_format),
                        option=orjson.OPT_SERIALIZE_NUMPY)


KINDS: dict[str, Callable[[Models, bytes], Awaitable[bytes]]] = {"embeddings": run_embeddings}
