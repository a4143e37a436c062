"""Cached weights, 20 points: the cluster already holds the model's weights, so a replica starts without a
download."""

from __future__ import annotations

import numpy as np

from embedfleet.operator.scheduling.scores.base import Candidates

CACHED_POINTS = 20.0


def cached(candidates: Candidates) -> np.ndarray:
    return CACHED_POINTS * candidates.cached
