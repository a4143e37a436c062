"""Score plugins: among clusters that pass the filters, which are better? Higher is better, 0..100.

Scores *order* clusters (which standby region takes over, which clusters a ``maxClusters`` spread keeps,
where overflow spills, which region ``minRegions`` adds next); the *amounts* come from static weights in
divide.py. Keeping scores out of the amounts is what makes placement stable: free capacity moves with
every other deployment, static weights do not.

One plugin per file, each a `Score` (base.py): facts about a deployment's candidates in, one array of
points out. `total` adds the points of the plugins in `SCORES`, left to right (the order fixes the
floating-point sums, so equal inputs give bit-equal scores):

  free     up to 40: share of the cluster's pool (this GPU type, or CPU slots) still free
  price    up to 30: the lowest cost per million embeddings among the candidates gets 30, the dearest 0
           (the hourly price when ``place`` ranks without costs)
  sticky   10 when the cluster already runs this deployment (moves cost cold starts)
  cached   20 when the cluster reports the deployment's weights already cached (no download)
"""

from __future__ import annotations

import numpy as np

from embedfleet.operator.scheduling.scores.base import Candidates, Score
from embedfleet.operator.scheduling.scores.cached import CACHED_POINTS, cached
from embedfleet.operator.scheduling.scores.free import FREE_POINTS, free
from embedfleet.operator.scheduling.scores.price import PRICE_POINTS, price
from embedfleet.operator.scheduling.scores.sticky import STICKY_POINTS, sticky

SCORES: tuple[Score, ...] = (free, price, sticky, cached)


def total(candidates: Candidates) -> np.ndarray:
    """Each candidate's score: the points of the plugins in `SCORES`, added left to right."""
    points = SCORES[0](candidates)
    for score in SCORES[1:]:
        points = points + score(candidates)
    return points


__all__ = [
    "CACHED_POINTS",
    "FREE_POINTS",
    "PRICE_POINTS",
    "SCORES",
    "STICKY_POINTS",
    "Candidates",
    "Score",
    "total",
]
