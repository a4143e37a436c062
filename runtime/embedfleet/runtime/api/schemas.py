"""Request and response bodies of every route (pydantic v2).

Shapes follow the APIs people already call: OpenAI embeddings and Hugging Face TEI.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[Annotated[int, Field(ge=0)]]


def timeout_field() -> Any:
    """`timeout` on every work body: optional, so OpenAI, TEI and Cohere clients that never send it
    are unaffected. Same meaning as the `X-Request-Timeout` header (the smaller of the two wins)."""
    return Field(None, gt=0, allow_inf_nan=False,
                 description="seconds this request may take; if it cannot be answered in time: 504")


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, a list of token ids, or a list of token-id lists")
    model: str | None = Field(None, description="served model name (see /v1/models)")
    timeout: float | None = timeout_field()
    encoding_format: Literal["float", "base64", "int8", "uint8", "binary", "ubinary", "int8_base64",
                             "uint8_base64", "binary_base64", "ubinary_base64"] = Field(
        "float", description="`base64`: little-endian float32 bytes, as OpenAI's SDK decodes them; `int8`, "
        "`uint8`, `binary`, `ubinary`: sentence-transformers' quantize_embeddings with the model's published "
        "ranges (GET /v1/models/{model}/quantization), as integer lists; `<type>_base64`: those bytes in base64")
    dimensions: int | None = Field(None, ge=1, description="Matryoshka: keep the first N dims, renormalised")
    user: str | None = None
    prompt_name: str | None = Field(None, description="a prompt from the model's sentence-transformers config")
    instruction: str | None = Field(None, description="raw text prefixed to every input (e.g. an instruction)")
    truncate: bool | None = Field(None, description="truncate inputs longer than the limit (default: server's)")
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    sparse_top_k: int | None = Field(None, ge=1, description="sparse (SPLADE) models only: keep the k heaviest "
                                     "terms; their `embedding` is {indices, values} (docs/outputs.md)")


class EmbeddingObject(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | list[int] | str | dict[str, list[int] | list[float]]  # dict: sparse {indices, values}


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
    instruction: str | None = None
    model: str | None = None
    timeout: float | None = timeout_field()


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
    architecture: str
    max_input_tokens: int
    dimensions: int
    labels: list[str]
    pooling: str
    dtype: str  # the precision served: "fp8" only if the quality gate accepted it
    device: str
    digest: str
    requested_dtype: str | None = None  # set when it differs from dtype (fp8 fell back to bf16)
    # fp8 requests: the quality gate's lowest calibration cosine (the figure it judged; rerankers: score
    # correlation), and the bound that figure had to reach, the threshold less its margin (engines/quality_gate.py)
    fp8_min_cosine: float | None = None
    fp8_required_cosine: float | None = None
    # int8 requests: what this process measured (never a cached build's stored figures), and on what: "judge"
    # (it built the int8 model and judged it on the judged set) or "probe" (it judged a cached build again on the
    # probe); all None for a cached refusal taken as stored (engines/int8_cpu.py, engines/int8_scoring_gate.py)
    int8_measured_on: str | None = None
    int8_min_cosine: float | None = None  # embedders: the lowest cosine with float32
    # int8 rerankers and classifiers: what the scoring gate measured (engines/int8_scoring_gate.py)
    int8_min_spearman: float | None = None
    int8_mean_spearman: float | None = None
    int8_top1_agreement: float | None = None
    int8_label_agreement: float | None = None
    int8_max_prob_diff: float | None = None
    # on CUDA: the batching served (engines/gpu_batching.py) and what chose each value ("user" or "device")
    batching: dict | None = None
    packed: bool | None = None  # runs packed sequences (engines/packed.py, packed_cpu.py); None: not torch
    # revisions (docs/rollouts.md): also answers `<id>@<revision>`; requests pinned to another space get 409
    revision: str | None = None
    vector_space: str | None = None
    fingerprint: str | None = None  # sha256 of the start-up outputs on the canonical probe set
    probe_set: str | None = None  # the probe set's version


class ProbeAnswer(BaseModel):
    """GET /v1/models/{model}/probe: the model's outputs on the canonical probe set (core/probe.py says
    what a row is per task). The shape a --probe-reference file holds."""

    model: str
    revision: str | None
    vector_space: str
    fingerprint: str  # of the start-up outputs: this revision's identity
    probe_set: str
    task: str
    outputs: list[list[float]]
    fresh: bool = False  # re-run now (?fresh=1) rather than the start-up outputs
    outputs_fingerprint: str  # of these outputs (equal to `fingerprint` unless fresh outputs moved)
    gate: dict | None = None  # fresh: these outputs against the drift reference (compat.gate)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


TruncationDirection = Literal["right", "left", "Right", "Left"]


class RerankRequest(BaseModel):
    """TEI / BEI shape."""

    model_config = ConfigDict(extra="ignore")

    query: str = Field(min_length=1)
    texts: list[str] = Field(min_length=1)
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "right"
    model: str | None = None
    timeout: float | None = timeout_field()


class CohereDocument(BaseModel):
    text: str


class CohereRerankRequest(BaseModel):
    """Cohere / Jina shape (also what vLLM and Infinity accept on /v1/rerank)."""

    model_config = ConfigDict(extra="ignore")

    query: str = Field(min_length=1)
    documents: list[str | CohereDocument] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "right"
    model: str | None = None
    timeout: float | None = timeout_field()


class RankTEI(BaseModel):
    index: int
    score: float
    text: str | None = None


class CohereResult(BaseModel):
    index: int
    relevance_score: float
    document: CohereDocument | None = None


class CohereRerankResponse(BaseModel):
    id: str
    model: str
    results: list[CohereResult]
    usage: Usage


PredictItem = str | Annotated[list[str], Field(min_length=2, max_length=2)]


class PredictRequest(BaseModel):
    """TEI / BEI /predict: a text, a pair [a, b], or a list of texts and pairs."""

    model_config = ConfigDict(extra="ignore")

    inputs: str | list[PredictItem]
    raw_scores: bool = False
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "right"
    model: str | None = None
    timeout: float | None = timeout_field()


class LabelScore(BaseModel):
    label: str
    score: float


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str]
    raw_scores: bool = False
    top_k: int | None = Field(None, ge=1)
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "right"
    model: str | None = None
    timeout: float | None = timeout_field()


class Classification(BaseModel):
    index: int
    label: str
    labels: list[LabelScore]


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[Classification]
    usage: Usage
