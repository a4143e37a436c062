"""Bodies of the sparse (/embed_sparse) and multi-vector (/embed_all) routes, in TEI's shapes.

TEI has no pruning option and no query/document switch; `top_k` and `input_type` are ours, optional,
so a TEI client's body is accepted unchanged.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from embedfleet.runtime.api.schemas import TokenIds, TruncationDirection, timeout_field


class SparseEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str | list[str] | TokenIds | list[TokenIds]
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "right"
    prompt_name: str | None = None
    top_k: int | None = Field(None, ge=1, description="keep only the k heaviest terms of each input")
    model: str | None = None
    timeout: float | None = timeout_field()


class SparseValue(BaseModel):
    index: int = Field(description="token id (vocabulary index)")
    value: float = Field(description="SPLADE weight, > 0")


class EmbedAllRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str | list[str] | TokenIds | list[TokenIds]
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "right"
    input_type: Literal["query", "document"] = Field(
        "document", description="ColBERT models: mark the inputs as queries (query prefix, [MASK] expansion) "
        "or documents (document prefix, skiplist)")
    model: str | None = None
    timeout: float | None = timeout_field()
