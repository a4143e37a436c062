"""Result types: what a call returns besides the vectors (usage, timings) and rerank/classify rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .decode import Usage
from .errors import ResponseMismatchError


@dataclass(frozen=True)
class BatchTiming:
    """One batch of one call: which inputs, where it went, how long it took end to end."""

    start: int
    stop: int
    seconds: float
    endpoint: str
    attempts: int
    hedged: bool


@dataclass
class CallStats:
    """Per-call bookkeeping, also summed over the client's lifetime in `client.stats`."""

    usage: Usage = field(default_factory=Usage)
    requests: int = 0
    retries: int = 0
    hedges: int = 0
    batches: list[BatchTiming] = field(default_factory=list)

    def merge(self, other: CallStats) -> None:
        self.usage.add(other.usage)
        self.requests += other.requests
        self.retries += other.retries
        self.hedges += other.hedges


@dataclass
class EmbedResult:
    """`embeddings` rows are in input order; `stats` says what it cost."""

    embeddings: np.ndarray
    stats: CallStats


@dataclass(frozen=True)
class RerankHit:
    index: int
    score: float
    text: str | None = None


@dataclass(frozen=True)
class Label:
    label: str
    score: float


def parse_rerank(doc: Any, expected: int, offset: int) -> list[RerankHit]:
    """TEI rerank rows -> hits with indices shifted into the caller's document list."""
    if isinstance(doc, dict) and isinstance(doc.get("results"), list):  # Cohere shape
        doc = [
            {"index": r.get("index"), "score": r.get("relevance_score", r.get("score"))}
            for r in doc["results"]
        ]
    if not isinstance(doc, list):
        raise ResponseMismatchError("rerank response is not a list")
    if len(doc) != expected:
        raise ResponseMismatchError(f"server returned {len(doc)} scores for {expected} documents")
    hits: list[RerankHit] = []
    seen: set[int] = set()
    for pos, item in enumerate(doc):
        try:
            index, score = item["index"], float(item["score"])
        except (KeyError, TypeError, ValueError):
            raise ResponseMismatchError(f"rerank row {pos} has no index/score") from None
        if not isinstance(index, int) or not 0 <= index < expected or index in seen:
            raise ResponseMismatchError(f"rerank row {pos} has a bad or repeated index {index!r}")
        seen.add(index)
        hits.append(RerankHit(offset + index, score, item.get("text")))
    return hits


def parse_classify(doc: Any, expected: int) -> list[list[Label]]:
    """Our `/classify` shape ({data: [{index, labels}]}) or TEI `/predict` (list of label lists)."""
    rows: list[Any] = [None] * expected
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        items = doc["data"]
        if len(items) != expected:
            raise ResponseMismatchError(f"server returned {len(items)} results for {expected} inputs")
        for pos, item in enumerate(items):
            index = item.get("index", pos) if isinstance(item, dict) else None
            if not isinstance(index, int) or not 0 <= index < expected or rows[index] is not None:
                raise ResponseMismatchError(f"classify row {pos} has a bad or repeated index {index!r}")
            rows[index] = item.get("labels")
    elif isinstance(doc, list):
        if len(doc) != expected:
            raise ResponseMismatchError(f"server returned {len(doc)} results for {expected} inputs")
        rows = list(doc)
    else:
        raise ResponseMismatchError("classify response has neither 'data' nor a list")
    out: list[list[Label]] = []
    for pos, labels in enumerate(rows):
        if not isinstance(labels, list):
            raise ResponseMismatchError(f"classify row {pos} has no label list")
        try:
            parsed = [Label(str(x["label"]), float(x["score"])) for x in labels]
        except (KeyError, TypeError, ValueError):
            raise ResponseMismatchError(f"classify row {pos} has a malformed label") from None
        out.append(sorted(parsed, key=lambda lab: -lab.score))
    return out
