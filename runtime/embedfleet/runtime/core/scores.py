"""From logits to the scores each API promises: sigmoid for a single-output model, softmax otherwise."""

from __future__ import annotations

import numpy as np


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def relevance(logits: np.ndarray, raw: bool) -> np.ndarray:
    """One score per (query, document) pair; a 2-label model's score is the positive label's."""
    if logits.shape[1] == 1:
        return logits[:, 0] if raw else sigmoid(logits[:, 0])
    return logits[:, -1] if raw else softmax(logits)[:, -1]


def label_scores(logits: np.ndarray, raw: bool, multi_label: bool) -> np.ndarray:
    if raw:
        return logits
    if multi_label or logits.shape[1] == 1:
        return sigmoid(logits)
    return softmax(logits)
