"""Cost, up to 30 points: the candidate where this deployment's embeddings cost least gets 30, the dearest 0.

The figure is dollars per million embeddings (cost.py: hourly price over the throughput measured, or the
size-based prior, for this model on that pool), so a cluster cheaper per hour but slower per embedding
ranks below a dearer, faster one; without a cost ranking it is the hourly price. Bounded like every
plugin, so cost orders candidates among the other concerns and never overrides a filter.
"""

from __future__ import annotations

import numpy as np

from embedfleet.operator.scheduling.scores.base import Candidates

PRICE_POINTS = 30.0


def price(candidates: Candidates) -> np.ndarray:
    spread = candidates.dearest - candidates.cheapest
    varies = spread > 0
    points = PRICE_POINTS * (candidates.dearest - candidates.cost) / np.where(varies, spread, 1.0)
    return np.where(varies, points, PRICE_POINTS)
