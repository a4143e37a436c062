"""Request and response bodies of every route (pydantic v2).

Shapes follow the APIs people already call: OpenAI embeddings and Hugging Face TEI.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[Annotated[int, Field(ge=0)]]


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, a list of token ids, or a list of token-id lists")
    model: str | None = Field(None, description="served model name (see /v1/models)")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`base64`: little-endian float32 bytes, as OpenAI's SDK decodes them")
    dimensions: int | None = Field(None, ge=1, description="Matryoshka: keep the first N dims, renormalised")
    user: str | None = None
    truncate: bool | None = Field(None, description="truncate inputs longer than the limit (default: server's)")
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"


class EmbeddingObject(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingObject]
    model: str
    usage: Usage


class TEIEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str | list[str] | TokenIds | list[TokenIds]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    dimensions: int | None = Field(None, ge=1)
    prompt_name: str | None = None
    model: str | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "embedfleet"
    task: str
    max_input_tokens: int
    dimensions: int
    pooling: str
    dtype: str
    device: str
    digest: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
