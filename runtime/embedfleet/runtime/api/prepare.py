"""Request checks and preparation shared by every front-end (sync routes, async submission, async worker).

Each function raises `ApiError` with the status and message the client should see, so a job that
the async path accepts is exactly one the sync route would have run.
"""

from __future__ import annotations

from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.api.inputs import as_batch
from embedfleet.runtime.api.schemas import (
    ClassifyRequest,
    CohereRerankRequest,
    OpenAIEmbeddingRequest,
    RerankRequest,
    TEIEmbedRequest,
)
from embedfleet.runtime.core.tokenize import InputTooLong, Tokenized
from embedfleet.runtime.models.spec import Task
from embedfleet.runtime.service import Models, ModelService
from embedfleet.runtime.tenants import Tenant

ROUTE_TASKS: dict[str, tuple[Task, ...]] = {
    "/v1/embeddings": ("embed", "sparse"), "/embed": ("embed",), "/rerank": ("rerank", "multivector"),
    "/v1/rerank": ("rerank", "multivector"), "/embed_sparse": ("sparse",), "/embed_all": ("multivector",),
    # the async path (asyncq/) serves dense embeddings and cross-encoders only: sparse and multi-vector
    # models are refused there with this table's 400, never run through a body builder made for vectors
    "/async/v1/embeddings": ("embed",), "/async/rerank": ("rerank",), "/async/classify": ("classify",),
    "/predict": ("rerank", "classify"), "/classify": ("classify",),
    "/tokenize": ("embed", "rerank", "classify", "sparse", "multivector"),
    "/v2/embed": ("embed",), "/v2/rerank": ("rerank",), "/": ("embed", "rerank", "classify"),
    "/v1/models/{model}/probe": ("embed", "rerank", "classify", "sparse", "multivector"),
}
KIND = {"embed": "an embedding model", "rerank": "a reranker (cross-encoder)", "classify": "a classifier",
        "sparse": "a sparse (SPLADE) model", "multivector": "a multi-vector (ColBERT) model"}


def select(models: Models, name: str | None, route: str, tenant: Tenant | None = None) -> ModelService:
    """The model a request names (or the first of the route's kind), loaded and of the right kind, and
    one the caller's tenant may use (403 otherwise: the tenant's key is valid, this model is not its)."""
    tasks = ROUTE_TASKS[route]
    svc = models.pick(name, tasks[0])
    if svc is None:
        raise ApiError(404, f"model {name!r} is not served here; available: {models.served_names()}",
                       "model_not_found")
    if tenant is not None and not tenant.allows(svc.name):
        models.metrics.tenant_refused.labels(tenant.name, "model_not_allowed").inc()
        raise ApiError(403, f"tenant {tenant.name!r} may not use model {svc.name!r}; its models: "
                       f"{sorted(tenant.models)}", "model_not_allowed")
    if not svc.loaded:
        raise ApiError(503, svc.not_loaded_message, "loading", {"retry-after": "2"})
    if svc.task not in tasks:
        wanted = " or ".join(KIND[t] for t in tasks)
        raise ApiError(400, f"{route} needs {wanted}, but {svc.name!r} is {KIND[svc.task]}; "
                       f"models here: {models.names()}", "wrong_model_kind")
    return svc


def truncation(svc: ModelService, truncate: bool | None) -> bool:
    return svc.settings.auto_truncate if truncate is None else truncate


async def tokenize(svc: ModelService, raw, truncate: bool | None, direction: str,
                   prefix: str = "") -> list[Tokenized]:
    batch = as_batch(raw, svc.settings.max_client_batch_size, svc.tokenizer.tokenizer.get_vocab_size())
    if prefix and isinstance(batch[0], str):
        batch = [prefix + text for text in batch]
    try:
        return await svc.tokenize(batch, truncation(svc, truncate), direction.lower())
    except InputTooLong as exc:
        raise ApiError(413, str(exc), "input_too_long") from exc


async def tokenize_pairs(svc: ModelService, pairs: list[tuple[str, str]], truncate: bool | None,
                         direction: str) -> list[Tokenized]:
    limit = svc.settings.max_client_batch_size
    if len(pairs) > limit:
        raise ApiError(413, f"{len(pairs)} pairs is over the limit of {limit} per request "
                       "(--max-client-batch-size); split it", "batch_too_large")
    for i, (a, b) in enumerate(pairs):
        if not a.strip() or not b.strip():
            raise ApiError(422, f"pair {i} has an empty text", "empty_input")
    try:
        return await svc.tokenize_pairs(pairs, truncation(svc, truncate), direction.lower())
    except InputTooLong as exc:
        raise ApiError(413, str(exc).replace("input", "pair", 1), "input_too_long") from exc


def prompt_prefix(svc: ModelService, prompt_name: str | None, instruction: str | None) -> str:
    if prompt_name is not None:
        if prompt_name not in svc.spec.prompts:
            raise ApiError(422, f"prompt_name {prompt_name!r} is not one of the model's prompts "
                           f"{sorted(svc.spec.prompts)}", "unknown_prompt")
        return svc.spec.prompts[prompt_name]
    return instruction or ""


async def prepare_embedding(svc: ModelService, body: OpenAIEmbeddingRequest | TEIEmbedRequest,
                            raw_inputs) -> list[Tokenized]:
    """Dimensions, prompt prefix and tokenization: everything that can refuse an embedding request."""
    dim = svc.spec.hidden_size
    if body.dimensions is not None and body.dimensions > dim:
        raise ApiError(422, f"dimensions={body.dimensions} is more than the model's {dim}", "invalid_dimensions")
    prefix = prompt_prefix(svc, body.prompt_name, body.instruction)
    return await tokenize(svc, raw_inputs, body.truncate, body.truncation_direction, prefix)


async def prepare_rerank(svc: ModelService, body: RerankRequest | CohereRerankRequest) -> list[Tokenized]:
    """One (query, document) pair per document, each truncated on the document side first."""
    docs = body.texts if isinstance(body, RerankRequest) else documents(body)
    return await tokenize_pairs(svc, [(body.query, d) for d in docs], body.truncate, body.truncation_direction)


def documents(body: CohereRerankRequest) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in body.documents]


async def prepare_classify(svc: ModelService, body: ClassifyRequest) -> list[Tokenized]:
    return await tokenize(svc, body.input, body.truncate, body.truncation_direction)
