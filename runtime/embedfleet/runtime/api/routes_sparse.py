"""Sparse (SPLADE) embeddings: TEI's POST /embed_sparse, and /v1/embeddings' shape for sparse models.

The engine returns a vocabulary-sized row per input (engines/torch_engine.splade_pool); core/sparse.py
keeps its non-zero terms. On /v1/embeddings a sparse model's `embedding` is `{"indices", "values"}`
(docs/outputs.md) whatever `encoding_format` says of float or base64: the OpenAI SDK asks for base64
unless told otherwise and leaves an `embedding` that is not a string as it is. Quantised formats and
`dimensions` have no meaning for sparse weights and are refused.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, body_of, parse, run
from embedfleet.runtime.api.prepare import prompt_prefix, select, tokenize
from embedfleet.runtime.api.schemas import OpenAIEmbeddingRequest
from embedfleet.runtime.api.schemas_outputs import SparseEmbedRequest, SparseValue
from embedfleet.runtime.core.sparse import openai_sparse, tei_sparse
from embedfleet.runtime.service import Models, ModelService


async def openai_sparse_embeddings(svc: ModelService, body: OpenAIEmbeddingRequest, request: Request) -> JSON:
    """/v1/embeddings on a sparse model (routes_embed.py hands it over after `select`)."""
    if body.encoding_format not in ("float", "base64"):
        raise ApiError(422, f"encoding_format={body.encoding_format!r} is not available for the sparse model "
                       f"{svc.name!r}: its embeddings are {{indices, values}} objects", "invalid_encoding_format")
    if body.dimensions is not None:
        raise ApiError(422, f"dimensions does not apply to the sparse model {svc.name!r}; use sparse_top_k to "
                       "keep the heaviest terms", "invalid_dimensions")
    prefix = prompt_prefix(svc, body.prompt_name, body.instruction)
    tokenized = await tokenize(svc, body.input, body.truncate, body.truncation_direction, prefix)
    result = await run(svc, tokenized, request, body.timeout)
    return JSON(openai_sparse(svc.name, result.rows, result.tokens, body.sparse_top_k))


def sparse_router(models: Models) -> APIRouter:
    settings = models.settings
    router = APIRouter(default_response_class=JSON)

    @router.post("/embed_sparse", response_model=list[list[SparseValue]], tags=["TEI"],
                 openapi_extra=body_of(SparseEmbedRequest))
    async def embed_sparse(request: Request):
        """TEI's /embed_sparse: per input, its terms with weight > 0 as {index, value}, by token id."""
        body = await parse(request, SparseEmbedRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/embed_sparse", tenant_of(request.scope))
        prefix = prompt_prefix(svc, body.prompt_name, None)
        tokenized = await tokenize(svc, body.inputs, body.truncate, body.truncation_direction, prefix)
        result = await run(svc, tokenized, request, body.timeout)
        return JSON(tei_sparse(result.rows, body.top_k))

    return router
