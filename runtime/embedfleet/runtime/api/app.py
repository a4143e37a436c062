"""The FastAPI application: routes only. Work goes to `ModelService`s; limits to `Gate`."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from embedfleet.runtime.api import errors
from embedfleet.runtime.api.bodies import classify_body, cohere_body, embeddings_body, labelled, rerank_body
from embedfleet.runtime.api.gate import Gate, GateState
from embedfleet.runtime.api.inputs import as_batch
from embedfleet.runtime.api.prepare import (
    documents,
    prepare_classify,
    prepare_embedding,
    prepare_rerank,
    select,
    tokenize,
    tokenize_pairs,
)
from embedfleet.runtime.api.schemas import (
    ClassifyRequest,
    ClassifyResponse,
    CohereRerankRequest,
    CohereRerankResponse,
    ModelCard,
    ModelList,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    PredictRequest,
    RankTEI,
    RerankRequest,
    SimpleToken,
    TEIEmbedRequest,
    TokenizeRequest,
)
from embedfleet.runtime.core.batcher import QueueFull
from embedfleet.runtime.core.oom import is_out_of_memory
from embedfleet.runtime.core.postprocess import finish
from embedfleet.runtime.core.tokenize import Tokenized, TooManyTokens
from embedfleet.runtime.service import ClientGone, Models, ModelService

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

WORK_ROUTES = frozenset({"/v1/embeddings", "/embed", "/tokenize", "/rerank", "/v1/rerank", "/predict",
                         "/classify", "/async/v1/embeddings", "/async/rerank", "/async/classify"})


class JSON(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


REQUEST_MODELS: dict[str, type[BaseModel]] = {}


def body_of(model: type[BaseModel]) -> dict:
    """OpenAPI for a body we parse ourselves (orjson, any content type) instead of via FastAPI."""
    REQUEST_MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


async def load_json(request: Request) -> dict:
    """The body as a JSON object, whatever the content type says."""
    try:
        data = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise errors.ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise errors.ApiError(422, f"the body must be a JSON object, not {type(data).__name__}", "invalid_request")
    return data


def validate(data: dict, model: type[M]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def parse(request: Request, model: type[M]) -> M:
    return validate(await load_json(request), model)


def with_request_schemas(app: FastAPI) -> Callable[[], dict]:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in REQUEST_MODELS.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[name] = body
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


async def wait_disconnect(receive) -> None:
    """Resolves when the client closes its connection (the body is already read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def create_app(models: Models, gate_state: GateState,
               on_load_failed: Callable[[], None] | None = None) -> FastAPI:
    settings = models.settings
    metrics = models.metrics
    load_task: dict[str, asyncio.Task] = {}

    async def lifespan(_: FastAPI):
        async def load() -> None:
            try:
                await models.load()
                metrics.ready.set(1)
            except Exception:
                if on_load_failed:
                    on_load_failed()

        load_task["t"] = asyncio.create_task(load())
        yield
        load_task["t"].cancel()
        await models.close()

    app = FastAPI(title="embedfleet runtime", version="0.1.0", lifespan=lifespan, default_response_class=JSON,
                  description="OpenAI-, TEI- and Cohere-compatible embedding, rerank and classification server "
                  "with token-budget batching.")
    errors.install(app, lambda status: metrics.errors.labels(str(status)).inc())
    app.add_middleware(
        Gate, api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        payload_limit=settings.payload_limit, max_concurrent=settings.max_concurrent_requests,
        state=gate_state, metrics=metrics, known_paths=WORK_ROUTES, queue_saturated=lambda: models.saturated)

    async def run(svc: ModelService, tokenized: list[Tokenized], request: Request):
        try:
            return await svc.run(tokenized, wait_disconnect(request.receive))
        except ClientGone:
            log.debug("client went away; its queued inputs were dropped")
            raise errors.ApiError(499, "client closed the request", "client_closed") from None
        except QueueFull as exc:
            # A condition of this replica now, not of the request: say when to come back, never 500.
            raise errors.ApiError(429, str(exc), "overloaded",
                                  {"retry-after": str(max(1, math.ceil(exc.retry_after)))}) from None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            log.warning("engine out of memory on a batch: %s", exc)
            raise errors.ApiError(503, "the engine ran out of memory on this batch; retry shortly (a smaller "
                                  "batch may fit)", "out_of_memory", {"retry-after": "1"}) from None

    @app.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, tags=["OpenAI"],
              openapi_extra=body_of(OpenAIEmbeddingRequest))
    async def openai_embeddings(request: Request):
        """OpenAI-compatible embeddings; vectors are unit length (as OpenAI's are)."""
        body = await parse(request, OpenAIEmbeddingRequest)
        svc = select(models, body.model, "/v1/embeddings")
        result = await run(svc, await prepare_embedding(svc, body, body.input), request)
        return JSON(embeddings_body(svc.name, result.rows, result.tokens, body.dimensions, body.encoding_format))

    @app.post("/embed", response_model=list[list[float]], tags=["TEI"], openapi_extra=body_of(TEIEmbedRequest))
    async def tei_embed(request: Request):
        """Text Embeddings Inference's /embed: a list of vectors in input order."""
        body = await parse(request, TEIEmbedRequest)
        svc = select(models, body.model, "/embed")
        result = await run(svc, await prepare_embedding(svc, body, body.inputs), request)
        return JSON(finish(result.rows, normalize=body.normalize, dimensions=body.dimensions))

    @app.post("/rerank", tags=["TEI", "Cohere"], openapi_extra=body_of(RerankRequest),
              response_model=list[RankTEI] | CohereRerankResponse)
    async def rerank(request: Request):
        """TEI/BEI shape (`texts`) -> ranked list; Cohere/Jina shape (`documents`) -> {results: [...]}."""
        data = await load_json(request)
        if "documents" in data:
            return await cohere_shape(validate(data, CohereRerankRequest), "/rerank", request)
        body = validate(data, RerankRequest)
        svc = select(models, body.model, "/rerank")
        result = await run(svc, await prepare_rerank(svc, body), request)
        return JSON(rerank_body(body, result.rows))

    @app.post("/v1/rerank", response_model=CohereRerankResponse, tags=["Cohere"],
              openapi_extra=body_of(CohereRerankRequest))
    async def cohere_rerank(request: Request):
        """Cohere / Jina rerank: relevance scores in [0, 1], best first, `top_n` of them."""
        return await cohere_shape(await parse(request, CohereRerankRequest), "/v1/rerank", request)

    async def cohere_shape(body: CohereRerankRequest, route: str, request: Request):
        svc = select(models, body.model, route)
        result = await run(svc, await prepare_rerank(svc, body), request)
        return JSON(cohere_body(svc, body, documents(body), result.rows, result.tokens))

    @app.post("/predict", tags=["TEI"], openapi_extra=body_of(PredictRequest))
    async def predict(request: Request):
        """TEI/BEI /predict: a text or a pair -> [{label, score}]; a list of them -> one list each."""
        body = await parse(request, PredictRequest)
        svc = select(models, body.model, "/predict")
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
        result = await run(svc, tokenized, request)
        out = labelled(svc, result.rows, body.raw_scores)
        return JSON(out[0] if single else out)

    @app.post("/classify", response_model=ClassifyResponse, tags=["embedfleet"],
              openapi_extra=body_of(ClassifyRequest))
    async def classify(request: Request):
        """Label texts with the model's `id2label` names; scores are softmax (sigmoid if multi-label)."""
        body = await parse(request, ClassifyRequest)
        svc = select(models, body.model, "/classify")
        result = await run(svc, await prepare_classify(svc, body), request)
        return JSON(classify_body(svc, body, result.rows, result.tokens))

    @app.post("/tokenize", response_model=list[list[SimpleToken]], tags=["TEI"],
              openapi_extra=body_of(TokenizeRequest))
    async def tokenize_route(request: Request):
        """Tokens with their ids, text and character offsets, as the engine will see them."""
        body = await parse(request, TokenizeRequest)
        svc = select(models, body.model, "/tokenize")
        texts = as_batch(body.inputs, settings.max_client_batch_size, svc.tokenizer.tokenizer.get_vocab_size())
        try:
            details = await svc.tokenizer.details(texts, body.add_special_tokens, max_tokens=settings.max_batch_tokens)
        except TooManyTokens as exc:
            raise errors.ApiError(413, str(exc), "too_many_tokens") from None
        return JSON(details)

    @app.get("/v1/models", response_model=ModelList, tags=["OpenAI"])
    async def list_models():
        if not models.loaded:
            raise errors.ApiError(503, "models are still loading; retry shortly", "loading", {"retry-after": "2"})
        cards = [ModelCard(id=s.name, created=s.created, task=s.task, max_input_tokens=s.input_limit,
                           dimensions=s.spec.hidden_size if s.task == "embed" else 0, labels=list(s.spec.labels),
                           pooling=s.spec.pooling, dtype=s.effective_dtype, device=settings.device,
                           digest=s.spec.digest, architecture=",".join(s.spec.architectures),
                           requested_dtype=settings.dtype if settings.dtype != s.effective_dtype else None,
                           fp8_min_cosine=s.fp8_min_cosine)
                 for s in models.services.values()]
        return JSON(ModelList(data=cards).model_dump())

    @app.get("/health", tags=["probes"])
    async def health():
        """Liveness: the process answers. Says nothing about the model."""
        return JSON({"status": "ok"})

    @app.get("/ready", tags=["probes"])
    async def ready():
        """Readiness: false while loading, draining after SIGTERM, or with a saturated queue."""
        if gate_state.draining:
            state = "draining"
        elif models.load_error:
            state = "failed"
        elif not models.loaded:
            state = "loading"
        elif models.saturated or gate_state.in_flight >= settings.max_concurrent_requests:
            state = "saturated"
        else:
            return JSON({"status": "ready"})
        return JSON({"status": state}, status_code=503)

    @app.get("/metrics", tags=["probes"])
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.redis_url:  # async jobs, workers and embedding cache on Redis (asyncq/); same checks as above
        from embedfleet.runtime.asyncq.routes import async_router

        app.include_router(async_router(models))

    app.openapi = with_request_schemas(app)
    return app
