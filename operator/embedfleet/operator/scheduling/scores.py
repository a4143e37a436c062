"""Score plugin weights: among clusters that pass the filters, which are better? Higher is better, 0..100.

Scores *order* clusters (which standby region takes over, which clusters a ``maxClusters`` spread keeps,
where overflow spills, which region ``minRegions`` adds next); the *amounts* come from static weights in
divide.py. Keeping scores out of the amounts is what makes placement stable: free capacity moves with
every other deployment, static weights do not. place._score_all computes, per candidate cluster:

  free     up to 40: share of the cluster's pool (this GPU type, or CPU slots) still free
  price    up to 30: the cheapest hourly price among the candidates gets 30, the dearest 0
  cached   20 when the cluster reports the deployment's weights already cached (no download)
  sticky   10 when the cluster already runs this deployment (moves cost cold starts)
"""

from __future__ import annotations

FREE_POINTS = 40.0
PRICE_POINTS = 30.0
CACHED_POINTS = 20.0
STICKY_POINTS = 10.0
