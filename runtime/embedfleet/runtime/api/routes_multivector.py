"""Multi-vector (ColBERT) outputs: TEI's POST /embed_all, and late-interaction scoring for /rerank.

Inputs are marked as queries or documents (core/multivector.py) from the model's PyLate config
(models/colbert.py); the engine returns unit-length per-token vectors, ragged; rerank scores each
document by MaxSim (core/maxsim.py). Scores are raw MaxSim sums (at most the query's token count),
on every rerank shape: there is no calibrated probability to give, so `raw_scores` changes nothing.
"""

from __future__ import annotations

import uuid

import numpy as np
from fastapi import APIRouter, Request

from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, body_of, parse, run
from embedfleet.runtime.api.inputs import as_batch
from embedfleet.runtime.api.prepare import documents, select, truncation
from embedfleet.runtime.api.schemas import CohereRerankRequest, RerankRequest
from embedfleet.runtime.api.schemas_outputs import EmbedAllRequest
from embedfleet.runtime.core.maxsim import maxsim_scores
from embedfleet.runtime.core.multivector import Marked, drop_skiplist, mark
from embedfleet.runtime.core.tokenize import InputTooLong, TokenizerPool
from embedfleet.runtime.service import Models, ModelService

MASK_TOKENS = ("[MASK]", "<mask>")


def token_id(svc: ModelService, text: str) -> int | None:
    """`text` as one token of the model's vocabulary (PyLate adds its markers as tokens), else None."""
    tok = svc.tokenizer.tokenizer
    for candidate in (text, text.strip()):
        if candidate and (found := tok.token_to_id(candidate)) is not None:
            return found
    return None


def skip_ids(svc: ModelService) -> frozenset[int]:
    words = svc.spec.colbert.skiplist if svc.spec.colbert is not None else ()
    return frozenset(i for w in words if (i := svc.tokenizer.tokenizer.token_to_id(w)) is not None)


async def encode_marked(svc: ModelService, raw, query: bool, truncate: bool | None, direction: str) -> list[Marked]:
    """Tokenize as a ColBERT query or document: within query_length / document_length, the marker token
    inserted after [CLS] (or, if the marker is not one token, prefixed as text), queries padded with
    [MASK] to query_length when the model expands queries."""
    cb = svc.spec.colbert
    assert cb is not None
    prefix = cb.query_prefix if query else cb.document_prefix
    marker = token_id(svc, prefix) if prefix else None
    limit = min(svc.input_limit, cb.query_length if query else cb.document_length) - (marker is not None)
    batch = as_batch(raw, svc.settings.max_client_batch_size, svc.tokenizer.tokenizer.get_vocab_size())
    texts = isinstance(batch[0], str)
    if prefix and marker is None and texts:
        batch = [prefix + text for text in batch]
    cut, way = truncation(svc, truncate), direction.lower()
    try:
        tokenized = await svc.tokenizer.encode(batch, limit, cut, way) if texts else \
            TokenizerPool.from_ids(batch, limit, cut, way)
    except InputTooLong as exc:
        raise ApiError(413, f"{exc} ({'query' if query else 'document'} length of {svc.name!r})",
                       "input_too_long") from exc
    expand, mask_id = 0, None
    if query and cb.expand_queries:
        mask_id = next((i for t in MASK_TOKENS if (i := token_id(svc, t)) is not None), None)
        if mask_id is None:
            raise ApiError(500, f"{svc.name!r} expands queries but its tokenizer has no mask token",
                           "model_misconfigured")
        expand = min(cb.query_length, svc.input_limit)
    return [mark(t, marker, expand, mask_id, cb.attend_to_expansion) for t in tokenized]


async def maxsim_rank(svc: ModelService, query: str, docs: list[str], truncate: bool | None, direction: str,
                      request: Request, body_timeout: float | None) -> tuple[np.ndarray, list[int], int]:
    """MaxSim scores, the order best first (ties keep input order) and the tokens run; the query and
    its documents go to the engine as one request."""
    q = await encode_marked(svc, [query], True, truncate, direction)
    d = await encode_marked(svc, docs, False, truncate, direction)
    result = await run(svc, q + d, request, body_timeout)
    skip = skip_ids(svc)
    vectors = [drop_skiplist(v, m.ids, skip) for v, m in zip(result.rows[1:], d, strict=True)]
    scores = maxsim_scores(result.rows[0], vectors)
    return scores, sorted(range(len(scores)), key=lambda i: (-scores[i], i)), result.tokens


async def maxsim_tei(svc: ModelService, body: RerankRequest, request: Request) -> list[dict]:
    """/rerank (TEI shape) for a ColBERT model: [{index, score, text?}], best first."""
    scores, order, _ = await maxsim_rank(svc, body.query, body.texts, body.truncate, body.truncation_direction,
                                         request, body.timeout)
    return [{"index": i, "score": float(scores[i]), **({"text": body.texts[i]} if body.return_text else {})}
            for i in order]


async def maxsim_cohere(svc: ModelService, body: CohereRerankRequest, request: Request) -> dict:
    """/v1/rerank (Cohere shape) for a ColBERT model; `relevance_score` is the MaxSim sum."""
    docs = documents(body)
    scores, order, tokens = await maxsim_rank(svc, body.query, docs, body.truncate, body.truncation_direction,
                                              request, body.timeout)
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in order[: body.top_n]]
    return {"id": str(uuid.uuid4()), "model": svc.name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def multivector_router(models: Models) -> APIRouter:
    settings = models.settings
    router = APIRouter(default_response_class=JSON)

    @router.post("/embed_all", response_model=list[list[list[float]]], tags=["TEI"],
                 openapi_extra=body_of(EmbedAllRequest))
    async def embed_all(request: Request):
        """TEI's /embed_all: per input, one unit-length vector per token (ColBERT-projected if the model
        has a projection); documents lose their skiplist tokens, queries keep their [MASK] expansion."""
        body = await parse(request, EmbedAllRequest, settings.max_client_batch_size)
        svc = select(models, body.model, "/embed_all", tenant_of(request.scope))
        query = body.input_type == "query"
        marked = await encode_marked(svc, body.inputs, query, body.truncate, body.truncation_direction)
        result = await run(svc, marked, request, body.timeout)
        skip = frozenset() if query else skip_ids(svc)
        return JSON([drop_skiplist(v, m.ids, skip) for v, m in zip(result.rows, marked, strict=True)])

    return router
