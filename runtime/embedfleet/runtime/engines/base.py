"""The interface every engine implements; the batch manager and API know nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Capabilities:
    tasks: tuple[str, ...]  # "embed", "rerank", "classify"
    pooling: str
    max_tokens: int
    dtypes: tuple[str, ...]
    device: str
    dim: int


class Engine(Protocol):
    capabilities: Capabilities

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """Pooled, unnormalised float32 vectors, one row per input, in input order."""
        ...


def pad_batch(batch: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into (ids, attention mask) int64 arrays."""
    width = max(len(x) for x in batch)
    ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    return ids, mask
