"""Free capacity, up to 40 points: the share of the candidate's pool still free, so load spreads out."""

from __future__ import annotations

import numpy as np

from embedfleet.operator.scheduling.scores.base import Candidates

FREE_POINTS = 40.0


def free(candidates: Candidates) -> np.ndarray:
    return FREE_POINTS * candidates.free / candidates.capacity
