"""Everything the async path runs beside a service, for a runtime replica or `embedfleet worker`.

One object owns the Redis client and the background tasks (job worker, webhook sender, queue
gauges) so that start-up and shutdown happen in one order: stop taking jobs, let running ones
finish (bounded), then close Redis; the service's batch manager is stopped only after that.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from embedfleet.runtime.asyncq.cache import VectorCache
from embedfleet.runtime.asyncq.delivery import WebhookSender
from embedfleet.runtime.asyncq.keys import Keys
from embedfleet.runtime.asyncq.store import JobStore, connect
from embedfleet.runtime.asyncq.worker import Worker, consumer_name
from embedfleet.runtime.service import Models

log = logging.getLogger(__name__)


class AsyncRuntime:
    def __init__(self, models: Models, run_worker: bool, name: str | None = None) -> None:
        settings = models.settings
        assert settings.redis_url, "the async path needs --redis-url"
        self.models = models
        self.settings = settings
        keys = Keys.for_deployment([entry.name for entry in settings.models()], settings.redis_prefix)
        self.store = JobStore(connect(settings.redis_url), keys)
        self.name = name or consumer_name()
        self.worker = Worker(self.store, models, self.name) if run_worker else None
        self.sender = WebhookSender(self.store, settings, self.name, models.metrics) if run_worker else None
        self.finish_rate = 0.0  # jobs finished per second across the fleet, for Retry-After
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        if self.settings.cache_enabled:
            variant = f"{self.settings.engine}-{self.settings.dtype}"
            cache = VectorCache(self.store.redis, self.store.keys, variant, self.settings.cache_ttl,
                                self.models.metrics)
            for service in self.models.services.values():
                service.vector_cache = cache
        self._tasks.append(asyncio.create_task(self._gauges(), name="asyncq-gauges"))
        if self.worker is not None and self.sender is not None:
            self._tasks.append(asyncio.create_task(self.worker.run(self._stop), name="asyncq-worker"))
            self._tasks.append(asyncio.create_task(self.sender.run(self._stop), name="asyncq-webhooks"))
        log.info("async path on (worker=%s, cache=%s)", self.worker is not None, self.settings.cache_enabled)

    async def stop(self, grace: float | None = None) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.worker is not None:
            await self.worker.drain(self.settings.drain_timeout if grace is None else grace)
        for service in self.models.services.values():
            service.vector_cache = None
        await self.store.close()

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: one job's share of the measured finish rate."""
        if self.finish_rate <= 0:
            return 5
        return int(min(60, max(1, round(1 / self.finish_rate))))

    async def _gauges(self) -> None:
        metrics = self.models.metrics
        loop = asyncio.get_running_loop()
        last: tuple[float, int] | None = None
        while not self._stop.is_set():
            try:
                depth, oldest = await self.store.depth()
                stats = await self.store.stats()
                dead = await self.store.dead_letter_count()
            except RedisError as exc:
                log.debug("queue gauges not updated: %s", exc)
            else:
                metrics.async_queue_depth.set(depth)
                metrics.async_oldest_job.set(oldest)
                metrics.async_dead_letters.set(dead)
                done = stats.get("succeeded", 0) + stats.get("failed", 0)
                now = loop.time()
                if last is not None and now > last[0]:
                    rate = max(0, done - last[1]) / (now - last[0])
                    self.finish_rate = rate if not self.finish_rate else 0.7 * self.finish_rate + 0.3 * rate
                last = (now, done)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=1.0)
            except TimeoutError:
                pass
