"""Response bodies, built once for the sync routes and the async worker (a job's result is exactly the
body its sync route would have answered)."""

from __future__ import annotations

import uuid

import numpy as np

from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.api.schemas import ClassifyRequest, CohereRerankRequest, RerankRequest
from embedfleet.runtime.core.postprocess import finish, to_base64
from embedfleet.runtime.core.quantize import Calibration, as_base64, as_json, quantize
from embedfleet.runtime.core.scores import label_scores, relevance
from embedfleet.runtime.service import ModelService


def embeddings_body(model: str, rows: np.ndarray, tokens: int, dimensions: int | None,
                    encoding_format: str, calibration: Calibration | None = None) -> dict:
    """`encoding_format` float/base64 as OpenAI; int8, uint8, binary, ubinary (and `<type>_base64`) are
    sentence-transformers' quantisation with `calibration`'s ranges (core/quantize.py)."""
    vectors = finish(rows, normalize=True, dimensions=dimensions)
    if encoding_format in ("float", "base64"):
        encode = to_base64 if encoding_format == "base64" else (lambda v: v)
        embeddings = [encode(v) for v in vectors]
    else:
        precision, _, b64 = encoding_format.partition("_")
        if precision in ("int8", "uint8") and calibration is None:
            raise ApiError(422, f"encoding_format {encoding_format!r} needs calibration ranges, which {model!r} "
                           "does not have (embedding models only)", "invalid_encoding_format")
        ranges = calibration.ranges(dimensions) if precision in ("int8", "uint8") else None
        quantized = quantize(vectors, precision, ranges)  # type: ignore[arg-type]
        embeddings = as_base64(quantized) if b64 else as_json(quantized)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def ranked(rows: np.ndarray, raw: bool) -> tuple[np.ndarray, list[int]]:
    """Relevance scores and the document order, best first (ties keep input order)."""
    scores = relevance(rows, raw)
    return scores, sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def rerank_body(body: RerankRequest, rows: np.ndarray) -> list[dict]:
    """TEI / BEI: [{index, score, text?}], best first."""
    scores, order = ranked(rows, body.raw_scores)
    return [{"index": i, "score": float(scores[i]), **({"text": body.texts[i]} if body.return_text else {})}
            for i in order]


def cohere_body(svc: ModelService, body: CohereRerankRequest, docs: list[str], rows: np.ndarray,
                tokens: int) -> dict:
    """Cohere / Jina: {id, model, results: [{index, relevance_score, document?}], usage}, top_n of them."""
    scores, order = ranked(rows, False)
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": docs[i]}} if body.return_documents else {})}
               for i in order[: body.top_n]]
    return {"id": str(uuid.uuid4()), "model": svc.name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def labelled(svc: ModelService, rows: np.ndarray, raw: bool, top_k: int | None = None) -> list[list[dict]]:
    scores = label_scores(rows, raw, svc.spec.multi_label)
    out = []
    for row in scores:
        order = sorted(range(len(row)), key=lambda k: -row[k])[:top_k]
        out.append([{"label": svc.spec.labels[k], "score": float(row[k])} for k in order])
    return out


def classify_body(svc: ModelService, body: ClassifyRequest, rows: np.ndarray, tokens: int) -> dict:
    labels = labelled(svc, rows, body.raw_scores, body.top_k)
    return {"object": "list", "model": svc.name,
            "data": [{"index": i, "label": r[0]["label"], "labels": r} for i, r in enumerate(labels)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
