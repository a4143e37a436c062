"""The one interface every score plugin implements: points for each candidate cluster, as one array.

A plugin sees facts, not clusters: what ``place`` already worked out about each candidate of one
deployment (the pool it would draw from, what a replica's work costs there, what the deployment ran there). Facts arrive
as arrays in candidate order, so a plugin scores a thousand clusters in a few numpy operations, and a new
plugin needs no change to ``place`` beyond listing it in ``scores.SCORES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Candidates:
    """Candidate clusters (those that passed a deployment's filters), one array entry each. ``place`` scores
    one deployment's candidates when it needs their order, and every placed (deployment, cluster) pair at
    once at the end, for the scores it reports: so entries may belong to different deployments.

    ``capacity`` is never 0: the GPU-type filter admits a cluster only with capacity in an allowed pool,
    and CPU candidates have CPU slots.
    """

    #: Units (GPUs, or CPU replica slots) still free in the pool a replica would draw from.
    free: np.ndarray
    #: That pool's size.
    capacity: np.ndarray
    #: What a replica's work costs there: dollars per million embeddings (cost.py), or, when ``place`` ranks
    #: by hourly price alone, the hourly price of one unit of that pool.
    cost: np.ndarray
    #: The lowest and the highest ``cost`` among the candidates of the entry's deployment.
    cheapest: np.ndarray
    dearest: np.ndarray
    #: Replicas the deployment's previous placement gave each cluster (0: none).
    previous: np.ndarray
    #: True where the cluster reports the deployment's weights already cached.
    cached: np.ndarray


#: Points (float array, one per candidate, higher is better) from a deployment's candidates.
Score = Callable[[Candidates], np.ndarray]
