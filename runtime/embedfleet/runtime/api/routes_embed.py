"""Embedding routes: OpenAI's /v1/embeddings and TEI's /embed, two wire shapes over one engine path."""

from __future__ import annotations

from fastapi import APIRouter, Request

from embedfleet.runtime.api.bodies import embeddings_body
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, body_of, parse, run
from embedfleet.runtime.api.prepare import prepare_embedding, select
from embedfleet.runtime.api.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse, TEIEmbedRequest
from embedfleet.runtime.core.postprocess import finish
from embedfleet.runtime.service import Models


def embed_router(models: Models) -> APIRouter:
    """The embedding routes over `models`; bodies are parsed by us (api/http.py), not by FastAPI."""
    settings = models.settings
    router = APIRouter(default_response_class=JSON)

    @router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, tags=["OpenAI"],
                 openapi_extra=body_of(OpenAIEmbeddingRequest))
    async def openai_embeddings(request: Request):
        """OpenAI-compatible embeddings; vectors are unit length (as OpenAI's are)."""
        body = await parse(request, OpenAIEmbeddingRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/v1/embeddings", tenant_of(request.scope))
        result = await run(svc, await prepare_embedding(svc, body, body.input), request, body.timeout)
        return JSON(embeddings_body(svc.name, result.rows, result.tokens, body.dimensions, body.encoding_format))

    @router.post("/embed", response_model=list[list[float]], tags=["TEI"], openapi_extra=body_of(TEIEmbedRequest))
    async def tei_embed(request: Request):
        """Text Embeddings Inference's /embed: a list of vectors in input order."""
        body = await parse(request, TEIEmbedRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/embed", tenant_of(request.scope))
        result = await run(svc, await prepare_embedding(svc, body, body.inputs), request, body.timeout)
        return JSON(finish(result.rows, normalize=body.normalize, dimensions=body.dimensions))

    return router
