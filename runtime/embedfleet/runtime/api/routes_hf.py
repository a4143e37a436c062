"""POST / : the model's default route, as TEI serves it and as Hugging Face's InferenceClient calls it.

`InferenceClient(base_url=...)` (huggingface_hub 2.x) posts every task to the base URL itself:
`feature_extraction` sends TEI's /embed body ({"inputs", "normalize", "truncate", "prompt_name", ...} at
the top level) and reads a list of vectors; `text_classification` sends {"inputs", "parameters":
{"top_k", "function_to_apply"}} and reads one list of {label, score} per input, nested even for a single
text (it takes element [0]). So the route serves the model the body names (`model`), else the first
served model, by that model's kind: embed -> /embed, classify -> the nested label lists above,
rerank -> TEI's /rerank ({query, texts}).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from embedfleet.runtime.api.bodies import rerank_body
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON, load_json, run, validate
from embedfleet.runtime.api.prepare import prepare_embedding, prepare_rerank, select, tokenize
from embedfleet.runtime.api.schemas import RerankRequest, TEIEmbedRequest, TruncationDirection, timeout_field
from embedfleet.runtime.core.postprocess import finish
from embedfleet.runtime.core.scores import label_scores, sigmoid, softmax
from embedfleet.runtime.service import Models

ScoreFunction = Literal["sigmoid", "softmax", "none"]


class TextClassificationParameters(BaseModel):
    model_config = ConfigDict(extra="ignore")

    top_k: int | None = Field(None, ge=1, description="keep the k best labels per input (default: all)")
    function_to_apply: ScoreFunction | None = Field(
        None, description="default: the model's own (softmax; sigmoid for multi-label or one-logit models)")


class TextClassificationRequest(BaseModel):
    """Hugging Face's text-classification task body."""

    model_config = ConfigDict(extra="ignore")

    inputs: str | list[str]
    parameters: TextClassificationParameters = Field(default_factory=TextClassificationParameters)
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "right"
    model: str | None = None
    timeout: float | None = timeout_field()


def scored(logits: np.ndarray, function: ScoreFunction | None, multi_label: bool) -> np.ndarray:
    """Scores per label as transformers' pipeline names them; None is the model's default."""
    if function is None:
        return label_scores(logits, False, multi_label)
    return {"sigmoid": sigmoid, "softmax": softmax}.get(function, lambda x: x)(logits)


def default_router(models: Models) -> APIRouter:
    settings = models.settings
    router = APIRouter(default_response_class=JSON)

    @router.post("/", tags=["TEI", "Hugging Face"])
    async def default_route(request: Request):
        """The default route of the model named by `model` (else the first served): embed, classify or rerank."""
        data = await load_json(request, settings.max_client_batch_size)
        name = data.get("model") if isinstance(data.get("model"), str) else models.names()[0]
        svc = select(models, name, "/", tenant_of(request.scope))
        if svc.task == "embed":
            body = validate(data, TEIEmbedRequest)
            result = await run(svc, await prepare_embedding(svc, body, body.inputs), request, body.timeout)
            return JSON(finish(result.rows, normalize=body.normalize, dimensions=body.dimensions))
        if svc.task == "rerank":
            rerank = validate(data, RerankRequest)
            result = await run(svc, await prepare_rerank(svc, rerank), request, rerank.timeout)
            return JSON(rerank_body(rerank, result.rows))
        classify = validate(data, TextClassificationRequest)
        tokenized = await tokenize(svc, classify.inputs, classify.truncate, classify.truncation_direction)
        result = await run(svc, tokenized, request, classify.timeout)
        params = classify.parameters
        out = []
        for row in scored(result.rows, params.function_to_apply, svc.spec.multi_label):
            order = sorted(range(len(row)), key=lambda k: -row[k])[: params.top_k]
            out.append([{"label": svc.spec.labels[k], "score": float(row[k])} for k in order])
        return JSON(out)

    return router
