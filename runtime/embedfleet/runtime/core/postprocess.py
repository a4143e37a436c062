"""From pooled vectors to what the client asked for: Matryoshka slice, normalisation, encoding."""

from __future__ import annotations

import base64

import numpy as np


def finish(vectors: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """Slice first, then normalise, so a truncated Matryoshka vector is unit length again."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if normalize:  # ufuncs only: np.linalg.norm's Python-level checks cost more than the sum on one query
        norms = np.sqrt(np.add.reduce(vectors * vectors, axis=1, keepdims=True))
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors


def to_base64(vector: np.ndarray) -> str:
    """Little-endian float32, which is what OpenAI's SDK decodes with numpy.frombuffer."""
    return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
