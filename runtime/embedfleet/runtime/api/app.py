"""The FastAPI application: lifespan, the gate, error shapes and the routers; no route lives here.

Routes are in routes_embed.py, routes_rank.py, routes_meta.py and (with --redis-url) asyncq/routes.py;
what they share is in http.py. Names tests and callers imported from here before that split are
re-exported below so `from embedfleet.runtime.api.app import ...` keeps working.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from fastapi import FastAPI

from embedfleet.runtime.api import errors
from embedfleet.runtime.api.direct import DirectRoutes
from embedfleet.runtime.api.gate import Gate, GateState
from embedfleet.runtime.api.http import (
    JSON,
    LIST_FIELDS,
    REQUEST_MODELS,
    TEXT_LIST_FIELDS,
    body_of,
    deadline_of,
    is_bulk,
    load_json,
    parse,
    precheck,
    validate,
    wait_disconnect,
    with_request_schemas,
)
from embedfleet.runtime.api.routes_cohere import cohere_router
from embedfleet.runtime.api.routes_embed import embed_handlers, embed_router
from embedfleet.runtime.api.routes_hf import default_router
from embedfleet.runtime.api.routes_meta import meta_router
from embedfleet.runtime.api.routes_multivector import multivector_router
from embedfleet.runtime.api.routes_quantize import quantization_router
from embedfleet.runtime.api.routes_rank import rank_router
from embedfleet.runtime.api.routes_sparse import sparse_router
from embedfleet.runtime.service import Models
from embedfleet.runtime.startgc import release

__all__ = ["JSON", "LIST_FIELDS", "REQUEST_MODELS", "TEXT_LIST_FIELDS", "WORK_ROUTES", "body_of", "create_app",
           "deadline_of", "is_bulk", "load_json", "parse", "precheck", "validate", "wait_disconnect",
           "with_request_schemas"]

# Paths the gate labels by name in embedfleet_request_duration_seconds (any other is "other", so a
# scanner probing random paths cannot grow the label set).
WORK_ROUTES = frozenset({"/v1/embeddings", "/embed", "/tokenize", "/rerank", "/v1/rerank", "/predict",
                         "/classify", "/embed_sparse", "/embed_all", "/async/v1/embeddings", "/async/rerank",
                         "/async/classify",
                         "/v2/embed", "/v2/rerank", "/"})


# FastAPI (0.16x) opens its own OpenTelemetry spans and metrics for every request once a global tracer or
# meter provider is configured (opentelemetry-instrument does that), and looks the providers up on every
# request to know. The runtime traces itself with its own provider (--otel, tracing.py: one span per
# request, the engine's batch linked), so FastAPI's would double every span; off, the check is cheap.
NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                       if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def create_app(models: Models, gate_state: GateState,
               on_load_failed: Callable[[], None] | None = None, engine_uds: str | None = None,
               count_requests: bool = True, jobs: bool = True) -> FastAPI:
    """The server over `models`: the models load in the background (so /health answers at once and
    /ready says "loading"); `on_load_failed` is called if they cannot. Split serving (split/): `engine_uds`
    makes this a front process, whose routes it does not serve go to the engine's application on that socket;
    the engine's application does not count requests (`count_requests`), which its fronts have counted, and
    with several engines only the first runs the async jobs' routes and workers (`jobs`), as one server does;
    every engine reads and fills the embedding cache."""
    settings = models.settings
    metrics = models.metrics
    load_task: dict[str, asyncio.Task] = {}
    configured_space = settings.vector_space or settings.revision
    gate_state.pinning.serve(settings.revision, [configured_space] if configured_space else [])

    async def lifespan(_: FastAPI):
        async def load() -> None:
            try:
                await models.load()
                gate_state.pinning.serve(settings.revision, models.vector_spaces())  # the weights' spaces known now
                metrics.ready.set(1)
            except Exception:
                if on_load_failed:
                    on_load_failed()
            finally:
                release()  # the start is over: its objects frozen, the usual thresholds back (startgc.py)

        load_task["t"] = asyncio.create_task(load())
        yield
        load_task["t"].cancel()
        await models.close()

    app = FastAPI(title="embedfleet runtime", version="0.1.0", lifespan=lifespan, default_response_class=JSON,
                  description="OpenAI-, TEI- and Cohere-compatible embedding, rerank and classification server "
                  "with token-budget batching.", **NO_NATIVE_TELEMETRY)
    def count_error(status: int) -> None:
        metrics.errors.labels(str(status)).inc()

    errors.install(app, count_error)
    hot = embed_handlers(models)
    if engine_uds is not None:
        from embedfleet.runtime.split.proxy import ProxyRoutes

        app.add_middleware(ProxyRoutes, uds=engine_uds, payload_limit=settings.payload_limit)
    # Starlette wraps the app in middleware in reverse order of adding: the gate runs first, then the
    # direct dispatch of the hot routes (api/direct.py), then FastAPI for everything else.
    app.add_middleware(DirectRoutes, routes={("POST", path): h for path, h in hot.items()}, on_error=count_error)
    app.add_middleware(
        Gate, tenants=models.tenants,
        payload_limit=settings.payload_limit, max_concurrent=settings.max_concurrent_requests,
        state=gate_state, metrics=metrics, known_paths=WORK_ROUTES, queue_saturated=lambda: models.saturated,
        refusing_all=models.refusing_all, expected_wait=models.expected_wait, count=count_requests)

    # In this order, so the OpenAPI document lists the paths as it always has.
    app.include_router(embed_router(hot))
    app.include_router(rank_router(models))
    app.include_router(meta_router(models, gate_state))
    app.include_router(sparse_router(models))
    app.include_router(multivector_router(models))
    app.include_router(cohere_router(models))
    app.include_router(quantization_router(models))
    app.include_router(default_router(models))
    # async jobs, workers and embedding cache on Redis (asyncq/); same checks as above. Not in a front process:
    # its async routes go to the (first) engine, whose application runs the pod's one set of workers
    if settings.redis_url and engine_uds is None:
        from embedfleet.runtime.asyncq.routes import async_router

        app.include_router(async_router(models, jobs=jobs))

    app.openapi = with_request_schemas(app)
    return app
