"""What a job of each kind does, and the request body each kind accepts.

A job's result is exactly the body its sync route would have answered, so a client can switch
between `/v1/embeddings` and `/async/v1/embeddings` without a second parser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from pydantic import Field

from embedfleet.runtime.api.inputs import as_batch
from embedfleet.runtime.api.schemas import OpenAIEmbeddingRequest
from embedfleet.runtime.core.postprocess import finish, to_base64
from embedfleet.runtime.service import EmbeddingService


class AsyncEmbeddingRequest(OpenAIEmbeddingRequest):
    webhook_url: str | None = Field(
        None, description="POSTed the finished job (signed, see docs/async.md); http(s) only")


class JobFailed(Exception):
    """A permanent failure: running the job again would fail the same way."""


async def run_embeddings(service: EmbeddingService, request: bytes) -> bytes:
    settings = service.settings
    body = AsyncEmbeddingRequest.model_validate_json(request)
    assert service.tokenizer is not None and service.spec is not None
    batch = as_batch(body.input, settings.max_client_batch_size, service.tokenizer.tokenizer.get_vocab_size())
    truncate = settings.auto_truncate if body.truncate is None else body.truncate
    tokenized = await service.tokenize(batch, truncate, body.truncation_direction.lower())
    result = await service.embed(tokenized, urgent=False)
    vectors = finish(result.vectors, normalize=True, dimensions=body.dimensions)
    if body.encoding_format == "base64":
        data = [{"object": "embedding", "index": i, "embedding": to_base64(v)} for i, v in enumerate(vectors)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return orjson.dumps({"object": "list", "data": data, "model": service.served_name(),
                         "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens}},
                        option=orjson.OPT_SERIALIZE_NUMPY)


KINDS: dict[str, Callable[[EmbeddingService, bytes], Awaitable[bytes]]] = {"embeddings": run_embeddings}
