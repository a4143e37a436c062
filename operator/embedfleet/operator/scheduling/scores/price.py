"""Price, up to 30 points: the cheapest hourly price among the candidates gets 30, the dearest 0."""

from __future__ import annotations

import numpy as np

from embedfleet.operator.scheduling.scores.base import Candidates

PRICE_POINTS = 30.0


def price(candidates: Candidates) -> np.ndarray:
    spread = candidates.dearest - candidates.cheapest
    varies = spread > 0
    points = PRICE_POINTS * (candidates.dearest - candidates.price) / np.where(varies, spread, 1.0)
    return np.where(varies, points, PRICE_POINTS)
