"""The interface every engine implements; the batch manager and API know nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from embedfleet.runtime.engines.quality_gate import GateResult


@dataclass(frozen=True)
class Capabilities:
    tasks: tuple[str, ...]  # "embed", "rerank", "classify"
    pooling: str
    max_tokens: int
    dtypes: tuple[str, ...]
    device: str
    dim: int


class Engine(Protocol):
    """The engine's whole contract with the service (service.py uses nothing else).

    Batches are lists of token-id lists or of objects with `.ids` and `.type_ids` (pairs)."""

    capabilities: Capabilities
    effective_dtype: str  # the precision that runs ("fp8" only once the quality gate accepted it)
    fp8_gate: GateResult | None  # the FP8 start-up quality gate's result; None when FP8 was not asked for
    int8_gate: GateResult | None  # the int8 gate's result (engines/int8_cpu.py); None when int8 was not asked for

    def warmup(self) -> None:
        """Run the shapes live traffic will use once, before the server says it is ready."""
        ...

    def embed(self, batch: list) -> np.ndarray:
        """Pooled, unnormalised float32 vectors, one row per input, in input order."""
        ...

    def classify(self, batch: list) -> np.ndarray:
        """Raw logits (inputs x labels), float32; for pairs this is the reranker's score."""
        ...

    def embed_sparse(self, batch: list) -> np.ndarray:
        """SPLADE weights (inputs x vocabulary), float32, zero where a term is absent."""
        ...

    def embed_tokens(self, batch: list) -> list[np.ndarray]:
        """Unit-length per-token vectors: one (tokens x dim) float32 array per input (ragged)."""
        ...


@dataclass
class Padded:
    ids: np.ndarray
    mask: np.ndarray
    type_ids: np.ndarray | None


def pad_batch(batch: list, pad_id: int) -> Padded:
    """Right-pad into int64 arrays; segment ids only when some input has them."""
    seqs = [getattr(x, "ids", x) for x in batch]
    segments = [getattr(x, "type_ids", None) for x in batch]
    width = max(len(x) for x in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    types = np.zeros((len(seqs), width), dtype=np.int64) if any(s is not None for s in segments) else None
    for row, tokens in enumerate(seqs):
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
        if types is not None and segments[row] is not None:
            types[row, : len(tokens)] = segments[row]
    return Padded(ids, mask, types)
