"""Scoring routes: rerank (TEI and Cohere/Jina shapes), TEI's /predict and our /classify."""

from __future__ import annotations

from fastapi import APIRouter, Request

from embedfleet.runtime.api import errors
from embedfleet.runtime.api.bodies import classify_body, cohere_body, labelled, rerank_body
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, body_of, load_json, parse, run, validate
from embedfleet.runtime.api.prepare import (
    documents,
    prepare_classify,
    prepare_rerank,
    select,
    tokenize,
    tokenize_pairs,
)
from embedfleet.runtime.api.routes_multivector import maxsim_cohere, maxsim_tei
from embedfleet.runtime.api.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    CohereRerankRequest,
    CohereRerankResponse,
    PredictRequest,
    RankTEI,
    RerankRequest,
)
from embedfleet.runtime.core.tokenize import Tokenized
from embedfleet.runtime.service import Models


async def cohere_shape(models: Models, body: CohereRerankRequest, route: str, request: Request) -> JSON:
    """A Cohere/Jina-shaped rerank, whichever route it came in on (/v1/rerank, or /rerank with `documents`)."""
    svc = select(models, body.model, route, tenant_of(request.scope))
    if svc.task == "multivector":  # late interaction (ColBERT), routes_multivector.py
        return JSON(await maxsim_cohere(svc, body, request))
    result = await run(svc, await prepare_rerank(svc, body), request, body.timeout)
    return JSON(cohere_body(svc, body, documents(body), result.rows, result.tokens))


def rank_router(models: Models) -> APIRouter:
    """The scoring routes over `models`; bodies are parsed by us (api/http.py), not by FastAPI."""
    settings = models.settings
    router = APIRouter(default_response_class=JSON)

    @router.post("/rerank", tags=["TEI", "Cohere"], openapi_extra=body_of(RerankRequest),
                 response_model=list[RankTEI] | CohereRerankResponse)
    async def rerank(request: Request):
        """TEI/BEI shape (`texts`) -> ranked list; Cohere/Jina shape (`documents`) -> {results: [...]}."""
        data = await load_json(request, settings.max_client_batch_size)
        if "documents" in data:
            return await cohere_shape(models, validate(data, CohereRerankRequest), "/rerank", request)
        body = validate(data, RerankRequest)
        svc = select(models, body.model, "/rerank", tenant_of(request.scope))
        if svc.task == "multivector":
            return JSON(await maxsim_tei(svc, body, request))
        result = await run(svc, await prepare_rerank(svc, body), request, body.timeout)
        return JSON(rerank_body(body, result.rows))

    @router.post("/v1/rerank", response_model=CohereRerankResponse, tags=["Cohere"],
                 openapi_extra=body_of(CohereRerankRequest))
    async def cohere_rerank(request: Request):
        """Cohere / Jina rerank: relevance scores in [0, 1], best first, `top_n` of them."""
        body = await parse(request, CohereRerankRequest, settings.max_client_batch_size)
        return await cohere_shape(models, body, "/v1/rerank", request)

    @router.post("/predict", tags=["TEI"], openapi_extra=body_of(PredictRequest))
    async def predict(request: Request):
        """TEI/BEI /predict: a text or a pair -> [{label, score}]; a list of them -> one list each."""
        body = await parse(request, PredictRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/predict", tenant_of(request.scope))
        single = isinstance(body.inputs, str) or (len(body.inputs) == 2 and all(isinstance(x, str)
                                                                                 for x in body.inputs))
        items = [body.inputs] if single else list(body.inputs)
        if not items:
            raise errors.ApiError(422, "inputs must not be empty", "empty_input")
        pair_at = [i for i, x in enumerate(items) if isinstance(x, list)]
        text_at = [i for i, x in enumerate(items) if isinstance(x, str)]
        if single and isinstance(body.inputs, list):
            pair_at, text_at = [0], []
            items = [list(body.inputs)]
        if svc.task == "rerank" and text_at:
            raise errors.ApiError(422, f"{svc.name!r} is a reranker: every input must be a [query, document] pair",
                                  "pair_required")
        tokenized: list[Tokenized | None] = [None] * len(items)
        if text_at:
            for i, t in zip(text_at, await tokenize(svc, [items[i] for i in text_at], body.truncate,
                                                    body.truncation_direction), strict=True):
                tokenized[i] = t
        if pair_at:
            pairs = [(items[i][0], items[i][1]) for i in pair_at]
            for i, t in zip(pair_at, await tokenize_pairs(svc, pairs, body.truncate, body.truncation_direction),
                            strict=True):
                tokenized[i] = t
        result = await run(svc, tokenized, request, body.timeout)
        out = labelled(svc, result.rows, body.raw_scores)
        return JSON(out[0] if single else out)

    @router.post("/classify", response_model=ClassifyResponse, tags=["embedfleet"],
                 openapi_extra=body_of(ClassifyRequest))
    async def classify(request: Request):
        """Label texts with the model's `id2label` names; scores are softmax (sigmoid if multi-label)."""
        body = await parse(request, ClassifyRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/classify", tenant_of(request.scope))
        result = await run(svc, await prepare_classify(svc, body), request, body.timeout)
        return JSON(classify_body(svc, body, result.rows, result.tokens))

    return router
