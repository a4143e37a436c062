"""Cohere v2: /v2/embed (several embedding types in one call) and /v2/rerank, as `cohere.ClientV2` calls them.

Same engine path and checks as the other routes (select, tokenize, http.run); what differs is the
wire shape, `input_type` mapped to the model's own prompts, and errors in Cohere's shape
({"id", "message", "code"}), which the SDK hands to the caller as the `body` of BadRequestError and
its kin. Refusals made before a route runs (the gate's 401/413/429) keep the common shape.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from functools import wraps

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from embedfleet.runtime.api.bodies import ranked
from embedfleet.runtime.api.errors import ApiError, describe_validation
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, body_of, parse, run
from embedfleet.runtime.api.inputs import as_batch
from embedfleet.runtime.api.prepare import select, tokenize_pairs
from embedfleet.runtime.api.schemas_cohere import (
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereError,
    CohereV2RerankRequest,
    CohereV2RerankResponse,
)
from embedfleet.runtime.core.postprocess import finish
from embedfleet.runtime.core.quantize import encode_all, needs_ranges
from embedfleet.runtime.core.tokenize import InputTooLong
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.service import Models, ModelService

# Cohere's input_type -> the sentence-transformers prompt names that play that role, first found wins.
# Models name their prompts differently (E5/BGE "query"/"passage", Nomic "search_query"/"search_document").
ROLE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
ERROR_RESPONSES = {status: {"model": CohereError} for status in (400, 404, 413, 422)}


def role_prompt(prompts: dict[str, str], input_type: str | None) -> str:
    """The prefix for `input_type` from the model's prompts; none if the model has no prompt for that role
    (a symmetric model such as all-MiniLM embeds queries and documents alike)."""
    if input_type is None:
        return ""
    if input_type not in ROLE_PROMPTS:
        raise ApiError(422, f"input_type {input_type!r} is not supported here: texts only, one of "
                       f"{sorted(ROLE_PROMPTS)}", "unsupported_input_type")
    return next((prompts[name] for name in ROLE_PROMPTS[input_type] if name in prompts), "")


def texts_of(body: CohereEmbedRequest) -> list[str]:
    """`texts`, or the text parts of each of `inputs` (joined by newlines); images are refused."""
    if body.images:
        raise ApiError(422, "images are not supported: this server embeds text; send `texts`", "unsupported_input")
    if body.texts is not None and body.inputs is not None:
        raise ApiError(422, "send either `texts` or `inputs`, not both", "invalid_request")
    if body.inputs is not None:
        return ["\n".join(part.text for part in item.content) for item in body.inputs]
    return body.texts or []


def meta(tokens: int) -> dict:
    return {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens},
            "tokens": {"input_tokens": tokens}}


def cohere_errors(metrics: RuntimeMetrics,
                  handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Answer the route's refusals in Cohere's error shape, counted like every other error."""
    @wraps(handler)
    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            status, message, code, headers = exc.status, exc.message, exc.code, exc.headers
        except RequestValidationError as exc:
            (status, message, code), headers = describe_validation(exc), {}
        metrics.errors.labels(str(status)).inc()
        return JSON({"id": str(uuid.uuid4()), "message": message, "code": code}, status_code=status, headers=headers)

    return guarded


async def embed_inputs(svc: ModelService, body: CohereEmbedRequest) -> list:
    """Everything that can refuse a /v2/embed request: texts, dimension, prompt, tokens (max_tokens, truncate)."""
    texts = texts_of(body)
    if not texts:
        raise ApiError(422, "texts must not be empty: send at least one text", "empty_input")
    dim = svc.spec.hidden_size
    if body.output_dimension is not None and body.output_dimension > dim:
        raise ApiError(422, f"output_dimension={body.output_dimension} is more than the model's {dim}",
                       "invalid_dimensions")
    batch = as_batch(texts, svc.settings.max_client_batch_size, svc.tokenizer.tokenizer.get_vocab_size())
    prefix = role_prompt(svc.spec.prompts, body.input_type)
    limit = min(body.max_tokens or svc.input_limit, svc.input_limit)
    try:
        return await svc.tokenizer.encode([prefix + t for t in batch], limit, body.truncate != "NONE",
                                          "left" if body.truncate == "START" else "right")
    except InputTooLong as exc:
        raise ApiError(400, f"{exc} (truncate=NONE; send START or END to truncate)", "input_too_long") from None


def cohere_router(models: Models) -> APIRouter:
    """/v2/embed and /v2/rerank over `models`; bodies are parsed by us (api/http.py), not by FastAPI."""
    settings = models.settings
    router = APIRouter(default_response_class=JSON)

    async def v2_embed(request: Request) -> Response:
        """Cohere v2 embed: every requested type of the same vectors; int8/uint8/binary/ubinary equal
        sentence-transformers' quantize_embeddings of `float` with GET /v1/models/{model}/quantization's ranges."""
        body = await parse(request, CohereEmbedRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/v2/embed", tenant_of(request.scope))
        texts = texts_of(body)
        result = await run(svc, await embed_inputs(svc, body), request, body.timeout)
        vectors = finish(result.rows, normalize=True, dimensions=body.output_dimension)
        types = list(dict.fromkeys(body.embedding_types))
        calibration = await svc.calibrated() if needs_ranges(types) else None
        return JSON({"id": str(uuid.uuid4()), "response_type": "embeddings_by_type",
                     "embeddings": encode_all(vectors, types, calibration, body.output_dimension),
                     "texts": texts, "meta": meta(result.tokens)})

    async def v2_rerank(request: Request) -> Response:
        """Cohere v2 rerank: relevance scores in [0, 1] (as /v1/rerank), best first, `top_n` of them."""
        body = await parse(request, CohereV2RerankRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/v2/rerank", tenant_of(request.scope))
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        tokenized = await tokenize_pairs(svc, [(body.query, d) for d in docs], True, "right")
        result = await run(svc, tokenized, request, body.timeout)
        scores, order = ranked(result.rows, False)
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": docs[i]}} if body.return_documents else {})}
                   for i in order[: body.top_n]]
        return JSON({"id": str(uuid.uuid4()), "results": results, "meta": meta(result.tokens)})

    router.post("/v2/embed", response_model=CohereEmbedResponse, tags=["Cohere"], responses=ERROR_RESPONSES,
                openapi_extra=body_of(CohereEmbedRequest))(cohere_errors(models.metrics, v2_embed))
    router.post("/v2/rerank", response_model=CohereV2RerankResponse, tags=["Cohere"], responses=ERROR_RESPONSES,
                openapi_extra=body_of(CohereV2RerankRequest))(cohere_errors(models.metrics, v2_rerank))
    return router
