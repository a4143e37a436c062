"""Embedding cache in Redis: pooled vectors keyed by what determines them.

Key = model digest + engine precision + hash of the token ids. The token ids already fold in
every request parameter that changes the vector (truncation and its direction, prompt prefix,
text vs. token input); the ones that do not (dimensions, normalize, encoding_format) are applied
after the cache, so one entry serves all of them. A new model digest is a new key space, so a model
change invalidates by construction. The cache never fails a request: if Redis is away, it is a miss.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Awaitable, Callable

import numpy as np
from redis.asyncio import Redis
from redis.exceptions import RedisError

from embedfleet.runtime.asyncq.keys import Keys
from embedfleet.runtime.core.tokenize import Tokenized
from embedfleet.runtime.metrics import RuntimeMetrics

log = logging.getLogger(__name__)


def ids_hash(ids: list[int]) -> str:
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()[:40]


class VectorCache:
    def __init__(self, redis: Redis, keys: Keys, variant: str, ttl: int, metrics: RuntimeMetrics) -> None:
        self.redis, self.keys, self.variant, self.ttl, self.metrics = redis, keys, variant, ttl, metrics
        self._hits = self._lookups = 0

    def key(self, digest: str, ids: list[int]) -> str:
        return self.keys.cache(f"{digest}:{self.variant}", ids_hash(ids))

    async def through(self, digest: str, tokenized: list[Tokenized],
                      compute: Callable[[list[Tokenized]], Awaitable[np.ndarray]]) -> np.ndarray:
        """Rows in input order: known ones from Redis, the rest from `compute` (then stored)."""
        keys = [self.key(digest, t.ids) for t in tokenized]
        try:
            found = await self.redis.mget(keys)
        except RedisError as exc:
            log.warning("embedding cache unavailable, computing everything: %s", exc)
            found = [None] * len(keys)
        missing = [i for i, raw in enumerate(found) if raw is None]
        self._count(len(keys) - len(missing), len(keys))
        computed = await compute([tokenized[i] for i in missing]) if missing else None
        rows: list[np.ndarray] = [np.frombuffer(raw, dtype="<f4") if raw is not None else None for raw in found]
        if computed is not None:
            computed = np.asarray(computed, dtype=np.float32)
            for row, i in zip(computed, missing, strict=True):
                rows[i] = row
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for row, i in zip(computed, missing, strict=True):
                        pipe.set(keys[i], row.astype("<f4").tobytes(), ex=self.ttl)
                    await pipe.execute()
            except RedisError as exc:
                log.warning("could not store vectors in the embedding cache: %s", exc)
        return np.stack(rows)

    def _count(self, hits: int, lookups: int) -> None:
        self._hits += hits
        self._lookups += lookups
        self.metrics.cache_hits.inc(hits)
        self.metrics.cache_misses.inc(lookups - hits)
        self.metrics.cache_hit_ratio.set(self._hits / self._lookups if self._lookups else 0.0)
