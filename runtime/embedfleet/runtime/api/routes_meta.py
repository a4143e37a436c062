"""Routes about the server rather than through the engine: /tokenize, /v1/models (and each model's probe-set
outputs, /v1/models/{model}/probe) and the probes."""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import PlainTextResponse, Response

from embedfleet.compat.gate import compare
from embedfleet.runtime.api import errors
from embedfleet.runtime.api.gate import TENANT, GateState, tenant_of
from embedfleet.runtime.api.http import JSON, body_of, parse
from embedfleet.runtime.api.inputs import as_batch
from embedfleet.runtime.api.prepare import select
from embedfleet.runtime.api.schemas import ModelCard, ModelList, ProbeAnswer, SimpleToken, TokenizeRequest
from embedfleet.runtime.core.jobs import QueueFull
from embedfleet.runtime.core.probe import fingerprint, probe_body
from embedfleet.runtime.core.tokenize import TooManyTokens
from embedfleet.runtime.probe import ProbePending, ProbeUnavailable
from embedfleet.runtime.service import Models, ModelService

PROBE_WAIT_S = 3.0  # GET .../probe waits this long for a start-up probe still running, then answers 503 (retry)


def fp8_required_cosine(svc: ModelService) -> float | None:
    """The bound the FP8 gate's calibration minimum had to reach (its threshold less the margin), shown
    beside the minimum so a reader sees how close the verdict was; None when FP8 was not asked for."""
    gate = svc.engine.fp8_gate if svc.engine is not None else None
    return gate.required if gate is not None else None


def meta_router(models: Models, gate_state: GateState) -> APIRouter:
    """Tokenizer, model list and probes; /ready reads `gate_state` because draining and the concurrency
    limit are the gate's to know, not the models'."""
    settings = models.settings
    metrics = models.metrics
    router = APIRouter(default_response_class=JSON)

    @router.post("/tokenize", response_model=list[list[SimpleToken]], tags=["TEI"],
                 openapi_extra=body_of(TokenizeRequest))
    async def tokenize_route(request: Request):
        """Tokens with their ids, text and character offsets, as the engine will see them."""
        body = await parse(request, TokenizeRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/tokenize", tenant_of(request.scope))
        texts = as_batch(body.inputs, settings.max_client_batch_size, svc.tokenizer.tokenizer.get_vocab_size())
        try:
            details = await svc.tokenizer.details(texts, body.add_special_tokens, max_tokens=settings.max_batch_tokens)
        except TooManyTokens as exc:
            raise errors.ApiError(413, str(exc), "too_many_tokens") from None
        return JSON(details)

    @router.get("/v1/models", response_model=ModelList, tags=["OpenAI"])
    async def list_models(request: Request):
        """The models this caller's tenant may use (OpenAI lists only the models a key can reach)."""
        # here, not at the top: it brings torch, which a front process (split/; it proxies this route) never needs
        from embedfleet.runtime.engines.int8_scoring_gate import card_fields

        tenant = tenant_of(request.scope)
        if not models.loaded:
            raise errors.ApiError(503, "models are still loading; retry shortly", "loading", {"retry-after": "2"})
        cards = [ModelCard(id=s.name, created=s.created, task=s.task, max_input_tokens=s.input_limit,
                           dimensions=s.spec.output_dim, labels=list(s.spec.labels),
                           pooling=s.spec.pooling, dtype=s.effective_dtype, device=settings.device,
                           digest=s.spec.digest, architecture=",".join(s.spec.architectures),
                           requested_dtype=settings.dtype if settings.dtype != s.effective_dtype else None,
                           fp8_min_cosine=s.fp8_min_cosine, fp8_required_cosine=fp8_required_cosine(s),
                           int8_min_cosine=s.int8_min_cosine, revision=s.revision or None,
                           **card_fields(s.engine.int8_gate if s.engine is not None else None),
                           batching=s.batching.card() if s.batching is not None else None,
                           packed=getattr(s.engine, "runs_packed", None),
                           vector_space=s.vector_space, fingerprint=s.fingerprint,
                           probe_set=s.probe.outputs.probe_set if s.probe is not None else None)
                 for s in models.services.values() if tenant.allows(s.name)]
        return JSON(ModelList(data=cards).model_dump())

    @router.get("/v1/models/{model:path}/probe", response_model=ProbeAnswer, tags=["embedfleet"])
    async def model_probe(model: str, request: Request, fresh: bool = False):
        """The model's outputs on the canonical probe set: the start-up outputs its fingerprint was taken
        from, or with `?fresh=1` a re-run now (through the batch manager, like any bulk work) and its
        comparison with the drift reference. What an operator's drift gate compares between revisions."""
        # the start-up outputs are open (api/gate.py is_startup_probe): no tenant then
        svc = select(models, model, "/v1/models/{model}/probe", request.scope.get(TENANT))
        try:
            state = await svc.startup_probe(PROBE_WAIT_S)
        except ProbePending as exc:
            raise errors.ApiError(503, str(exc), "probe_pending", {"retry-after": "1"}) from None
        except ProbeUnavailable as exc:
            raise errors.ApiError(503, str(exc), "probe_failed") from None
        outputs, gate = state.outputs, None
        if fresh:
            try:
                outputs = await svc.run_probe()
            except QueueFull as exc:
                raise errors.ApiError(429, str(exc), "overloaded",
                                      {"retry-after": str(max(1, math.ceil(exc.retry_after)))}) from None
            gate = compare(state.reference, outputs, settings.probe_min_cosine).as_status()
        body = probe_body(svc.name, svc.revision or None, state.vector_space, state.fingerprint, outputs)
        body.update(fresh=fresh, gate=gate,
                    outputs_fingerprint=fingerprint(outputs.probe_set, outputs.task, outputs.outputs))
        return JSON(body)

    @router.get("/health", tags=["probes"])
    async def health():
        """Liveness: the process answers. Says nothing about the model."""
        return JSON({"status": "ok"})

    def state() -> str:
        """Readiness: loading, failed, draining after SIGTERM, saturated (a full queue, or a new small
        request would be refused for its expected wait: --max-queue-seconds), else ready."""
        if gate_state.draining:
            return "draining"
        if models.load_error:
            return "failed"
        if not models.loaded:
            return "loading"
        if models.saturated or models.overloaded or gate_state.in_flight >= settings.max_concurrent_requests:
            return "saturated"
        return "ready"

    @router.get("/ready", tags=["probes"])
    async def ready():
        """Readiness (see `state`): 200 when ready, else 503 with the state, so the load balancer sends
        work elsewhere."""
        now = state()
        return JSON({"status": now}, status_code=200 if now == "ready" else 503)

    @router.get("/load", tags=["probes"])
    async def load():
        """The replica's load for a gateway's cheap poll (no API key, like the probes): readiness,
        draining, requests in flight and, per model, queued tokens, drain rate and expected wait. The
        same expected wait rides on every answer as `x-embedfleet-expected-wait`. `startup`: this process's
        cold start by phase (cold_start.py), what the operator reads when the pod turns Ready."""
        now = state()
        return JSON({"ready": now == "ready", "status": now, "draining": gate_state.draining,
                     "in_flight": gate_state.in_flight, "models": models.load_report(),
                     "startup": models.startup_report()})

    @router.get("/metrics", tags=["probes"], response_class=PlainTextResponse)
    async def prometheus_metrics():
        return Response(generate_latest(metrics.exposition()), media_type=CONTENT_TYPE_LATEST)

    return router
