"""Late interaction (ColBERT's MaxSim): for each query token, its best match among the document's
tokens, summed over the query. Vectors are unit length, so the dot product is the cosine."""

from __future__ import annotations

import numpy as np


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Sum over query tokens of the max dot product with the document's tokens (0 for no tokens)."""
    if not len(query) or not len(document):
        return 0.0
    return float((query @ document.T).max(axis=1).sum())


def maxsim_scores(query: np.ndarray, documents: list[np.ndarray]) -> np.ndarray:
    return np.array([maxsim(query, d) for d in documents], dtype=np.float32)
