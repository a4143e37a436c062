"""Embedding routes: OpenAI's /v1/embeddings and TEI's /embed, two wire shapes over one engine path.

`embed_handlers` are the route functions by path; `embed_router` registers them with FastAPI (for the
OpenAPI document) and `create_app` also hands them to the gate's direct dispatch (api/direct.py), which
is how requests actually reach them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from embedfleet.runtime.api.bodies import embeddings_body
from embedfleet.runtime.api.direct import Handler
from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, body_of, parse, run
from embedfleet.runtime.api.prepare import prepare_embedding, select
from embedfleet.runtime.api.routes_sparse import openai_sparse_embeddings
from embedfleet.runtime.api.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse, TEIEmbedRequest
from embedfleet.runtime.core.postprocess import finish
from embedfleet.runtime.core.quantize import needs_ranges
from embedfleet.runtime.service import Models


def embed_handlers(models: Models) -> dict[str, Handler]:
    """POST handlers by path; bodies are parsed by us (api/http.py), not by FastAPI."""
    settings = models.settings

    async def openai_embeddings(request: Request):
        """OpenAI-compatible embeddings; vectors are unit length (as OpenAI's are)."""
        body = await parse(request, OpenAIEmbeddingRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/v1/embeddings", tenant_of(request.scope))
        if svc.task == "sparse":  # {indices, values} items (routes_sparse.py)
            return await openai_sparse_embeddings(svc, body, request)
        if body.sparse_top_k is not None:
            raise ApiError(422, f"sparse_top_k applies to sparse models only; {svc.name!r} is dense",
                           "invalid_sparse_top_k")
        result = await run(svc, await prepare_embedding(svc, body, body.input), request, body.timeout)
        calibration = await svc.calibrated() if needs_ranges(body.encoding_format) else None
        return JSON(embeddings_body(svc.name, result.rows, result.tokens, body.dimensions, body.encoding_format,
                                    calibration))

    async def tei_embed(request: Request):
        """Text Embeddings Inference's /embed: a list of vectors in input order."""
        body = await parse(request, TEIEmbedRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/embed", tenant_of(request.scope))
        result = await run(svc, await prepare_embedding(svc, body, body.inputs), request, body.timeout)
        return JSON(finish(result.rows, normalize=body.normalize, dimensions=body.dimensions))

    return {"/v1/embeddings": openai_embeddings, "/embed": tei_embed}


def embed_router(handlers: dict[str, Handler]) -> APIRouter:
    """The FastAPI registration of `embed_handlers` (documentation, and any caller that bypasses the gate)."""
    router = APIRouter(default_response_class=JSON)
    router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, tags=["OpenAI"],
                openapi_extra=body_of(OpenAIEmbeddingRequest))(handlers["/v1/embeddings"])
    router.post("/embed", response_model=list[list[float]], tags=["TEI"],
                openapi_extra=body_of(TEIEmbedRequest))(handlers["/embed"])
    return router
