"""Cohere v2 bodies (/v2/embed, /v2/rerank) as Cohere's SDK (cohere.ClientV2) sends and parses them.

Field names and values are Cohere's; extra fields are ignored as everywhere else, so a newer SDK that
adds an optional field keeps working. `timeout` is ours (same meaning as on every work body).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from embedfleet.runtime.api.schemas import CohereDocument, timeout_field

EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]
InputType = Literal["search_document", "search_query", "classification", "clustering", "image"]


class CohereTextContent(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = Field(description="only text content is embedded here; images get a 422")
    text: str


class CohereInput(BaseModel):
    """One of `inputs`: its text parts, joined by a newline, are embedded as one text."""

    model_config = ConfigDict(extra="ignore")

    content: list[CohereTextContent] = Field(min_length=1)


class CohereEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="served model name (see /v1/models)")
    input_type: InputType | None = Field(
        None, description="mapped to the model's sentence-transformers prompt of that role, if it has one")
    texts: list[str] | None = Field(None, description="the texts to embed (or `inputs`)")
    inputs: list[CohereInput] | None = None
    images: list[str] | None = Field(None, description="not supported: a 422")
    max_tokens: int | None = Field(None, ge=1, description="tokens kept per input (at most the model's limit)")
    output_dimension: int | None = Field(None, ge=1, description="Matryoshka: first N dims, renormalised")
    embedding_types: list[EmbeddingType] = Field(
        default_factory=lambda: ["float"], min_length=1,
        description="float, int8, uint8, binary, ubinary (sentence-transformers' quantize_embeddings with the "
        "ranges of GET /v1/models/{model}/quantization) and base64 (little-endian float32 bytes)")
    truncate: Literal["NONE", "START", "END"] = Field(
        "END", description="NONE: an over-long input is a 400; START/END: drop tokens from that end")
    priority: int | None = Field(None, description="accepted and ignored; send `X-Priority: bulk` instead")
    timeout: float | None = timeout_field()


class CohereV2RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | CohereDocument] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    max_tokens_per_doc: int | None = Field(
        None, ge=1, description="accepted; pairs are truncated to the model's input limit, document side first")
    return_documents: bool = False
    priority: int | None = None
    timeout: float | None = timeout_field()


class ApiVersion(BaseModel):
    version: str = "2"


class Units(BaseModel):
    input_tokens: int


class CohereMeta(BaseModel):
    api_version: ApiVersion
    billed_units: Units
    tokens: Units


class CohereEmbeddings(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    float_: list[list[float]] | None = Field(None, alias="float")
    int8: list[list[int]] | None = None
    uint8: list[list[int]] | None = None
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereEmbedResponse(BaseModel):
    id: str
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
    embeddings: CohereEmbeddings
    texts: list[str]
    meta: CohereMeta


class CohereV2Result(BaseModel):
    index: int
    relevance_score: float
    document: CohereDocument | None = None


class CohereV2RerankResponse(BaseModel):
    id: str
    results: list[CohereV2Result]
    meta: CohereMeta


class CohereError(BaseModel):
    """Cohere's error body: the SDK raises BadRequestError etc. with this as `body`."""

    id: str
    message: str
    code: str
