"""The FastAPI application: routes only. Work goes to `EmbeddingService`; limits to `Gate`."""

from __future__ import annotations

import asyncio
import logging
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
from embedfleet.runtime.api.gate import Gate, GateState
from embedfleet.runtime.api.inputs import as_batch
from embedfleet.runtime.api.schemas import (
    ModelCard,
    ModelList,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    SimpleToken,
    TEIEmbedRequest,
    TokenizeRequest,
)
from embedfleet.runtime.core.postprocess import finish, to_base64
from embedfleet.runtime.core.tokenize import InputTooLong, Tokenized
from embedfleet.runtime.service import ClientGone, EmbeddingService

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

WORK_ROUTES = frozenset({"/v1/embeddings", "/embed", "/tokenize"})


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


async def parse(request: Request, model: type[M]) -> M:
    """Read the body as JSON whatever the content type says, and validate it into `model`."""
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise errors.ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise errors.ApiError(422, f"the body must be a JSON object, not {type(data).__name__}", "invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


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


def create_app(service: EmbeddingService, gate_state: GateState,
               on_load_failed: Callable[[], None] | None = None) -> FastAPI:
    settings = service.settings
    metrics = service.metrics
    load_task: dict[str, asyncio.Task] = {}

    async def lifespan(_: FastAPI):
        async def load() -> None:
            try:
                await service.load()
                metrics.ready.set(1)
            except Exception:
                if on_load_failed:
                    on_load_failed()

        load_task["t"] = asyncio.create_task(load())
        yield
        load_task["t"].cancel()
        await service.close()

    app = FastAPI(title="embedfleet runtime", version="0.1.0", lifespan=lifespan, default_response_class=JSON,
                  description="OpenAI- and TEI-compatible embedding server with token-budget batching.")
    errors.install(app, lambda status: metrics.errors.labels(str(status)).inc())
    app.add_middleware(
        Gate, api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        payload_limit=settings.payload_limit, max_concurrent=settings.max_concurrent_requests,
        state=gate_state, metrics=metrics, known_paths=WORK_ROUTES,
        queue_saturated=lambda: service.batcher is not None and service.batcher.saturated)

    def loaded_service() -> EmbeddingService:
        if not service.loaded:
            raise errors.ApiError(503, "the model is still loading; retry shortly", "loading",
                                  {"retry-after": "2"})
        return service

    def check_model(name: str | None) -> None:
        if name is not None and name != service.served_name():
            raise errors.ApiError(404, f"model {name!r} is not served here; available: "
                                  f"{[service.served_name()]}", "model_not_found")

    def check_dimensions(dimensions: int | None) -> None:
        dim = service.spec.hidden_size if service.spec else 0
        if dimensions is not None and dimensions > dim:
            raise errors.ApiError(422, f"dimensions={dimensions} is more than the model's {dim}",
                                  "invalid_dimensions")

    async def tokenize(raw, truncate: bool | None, direction: str, prefix: str = "") -> list[Tokenized]:
        svc = loaded_service()
        batch = as_batch(raw, settings.max_client_batch_size, svc.tokenizer.tokenizer.get_vocab_size())
        if prefix and isinstance(batch[0], str):
            batch = [prefix + text for text in batch]
        try:
            return await svc.tokenize(batch, settings.auto_truncate if truncate is None else truncate,
                                      direction.lower())
        except InputTooLong as exc:
            raise errors.ApiError(413, str(exc), "input_too_long") from exc

    async def run(tokenized: list[Tokenized], request: Request):
        try:
            return await service.embed(tokenized, wait_disconnect(request.receive))
        except ClientGone:
            log.debug("client went away; its queued inputs were dropped")
            raise errors.ApiError(499, "client closed the request", "client_closed") from None

    @app.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, tags=["OpenAI"],
              openapi_extra=body_of(OpenAIEmbeddingRequest))
    async def openai_embeddings(request: Request):
        """OpenAI-compatible embeddings; vectors are unit length (as OpenAI's are)."""
        body = await parse(request, OpenAIEmbeddingRequest)
        check_model(body.model)
        check_dimensions(body.dimensions)
        tokenized = await tokenize(body.input, body.truncate, body.truncation_direction)
        result = await run(tokenized, request)
        vectors = finish(result.vectors, normalize=True, dimensions=body.dimensions)
        if body.encoding_format == "base64":
            data = [{"object": "embedding", "index": i, "embedding": to_base64(v)} for i, v in enumerate(vectors)]
        else:
            data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return JSON({"object": "list", "data": data, "model": service.served_name(),
                     "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens}})

    @app.post("/embed", response_model=list[list[float]], tags=["TEI"], openapi_extra=body_of(TEIEmbedRequest))
    async def tei_embed(request: Request):
        """Text Embeddings Inference's /embed: a list of vectors in input order."""
        body = await parse(request, TEIEmbedRequest)
        check_model(body.model)
        check_dimensions(body.dimensions)
        prefix = ""
        if body.prompt_name is not None:
            prompts = service.spec.prompts if service.spec else {}
            if body.prompt_name not in prompts:
                raise errors.ApiError(422, f"prompt_name {body.prompt_name!r} is not one of the model's prompts "
                                      f"{sorted(prompts)}", "unknown_prompt")
            prefix = prompts[body.prompt_name]
        tokenized = await tokenize(body.inputs, body.truncate, body.truncation_direction, prefix)
        result = await run(tokenized, request)
        return JSON(finish(result.vectors, normalize=body.normalize, dimensions=body.dimensions))

    @app.post("/tokenize", response_model=list[list[SimpleToken]], tags=["TEI"],
              openapi_extra=body_of(TokenizeRequest))
    async def tokenize_route(request: Request):
        """Tokens with their ids, text and character offsets, as the engine will see them."""
        body = await parse(request, TokenizeRequest)
        check_model(body.model)
        svc = loaded_service()
        texts = as_batch(body.inputs, settings.max_client_batch_size, svc.tokenizer.tokenizer.get_vocab_size())
        return JSON(await svc.tokenizer.details(texts, body.add_special_tokens))

    @app.get("/v1/models", response_model=ModelList, tags=["OpenAI"])
    async def models():
        svc = loaded_service()
        card = ModelCard(id=svc.served_name(), created=svc.created, task="embed", max_input_tokens=svc.input_limit,
                         dimensions=svc.spec.hidden_size, pooling=svc.spec.pooling, dtype=settings.dtype,
                         device=settings.device, digest=svc.spec.digest)
        return JSON(ModelList(data=[card]).model_dump())

    @app.get("/health", tags=["probes"])
    async def health():
        """Liveness: the process answers. Says nothing about the model."""
        return JSON({"status": "ok"})

    @app.get("/ready", tags=["probes"])
    async def ready():
        """Readiness: false while loading, draining after SIGTERM, or with a saturated queue."""
        if gate_state.draining:
            state = "draining"
        elif service.load_error:
            state = "failed"
        elif not service.loaded:
            state = "loading"
        elif service.batcher.saturated or gate_state.in_flight >= settings.max_concurrent_requests:
            state = "saturated"
        else:
            return JSON({"status": "ready"})
        return JSON({"status": state}, status_code=503)

    @app.get("/metrics", tags=["probes"])
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if settings.redis_url:  # async jobs, workers and embedding cache on Redis (asyncq/); reuses the checks above
        from embedfleet.runtime.asyncq.routes import async_router

        app.include_router(async_router(service, check_model, check_dimensions, tokenize))

    app.openapi = with_request_schemas(app)
    return app
