"""Stickiness, 10 points: the cluster already runs the deployment, and every move costs a cold start."""

from __future__ import annotations

import numpy as np

from embedfleet.operator.scheduling.scores.base import Candidates

STICKY_POINTS = 10.0


def sticky(candidates: Candidates) -> np.ndarray:
    return STICKY_POINTS * (candidates.previous > 0)
