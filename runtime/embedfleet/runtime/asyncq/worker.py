"""The job worker: a consumer in the `workers` group of the jobs stream.

At-least-once: an entry is acknowledged only by `JobStore.finish`, in the same atomic step that
stores the result. If this process dies, its entries stay pending and any worker takes them over
with XAUTOCLAIM once they have been idle for the visibility timeout; while we still work on an
entry we reset its idle time (XCLAIM JUSTID), so a slow job is not run twice for nothing. When a
job does run twice, `finish` keeps the first result and drops the second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from pydantic import ValidationError
from redis.exceptions import RedisError

from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.asyncq.keys import JOB_GROUP
from embedfleet.runtime.asyncq.kinds import KINDS, JobFailed
from embedfleet.runtime.asyncq.store import Entry, JobStore
from embedfleet.runtime.core.tokenize import InputTooLong
from embedfleet.runtime.service import Models

log = logging.getLogger(__name__)

PERMANENT = (ApiError, InputTooLong, ValidationError, JobFailed, ValueError)


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def reason(exc: BaseException) -> str:
    if isinstance(exc, ApiError):
        return f"{exc.code}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


class Worker:
    def __init__(self, store: JobStore, models: Models, name: str | None = None) -> None:
        settings = models.settings
        self.store = store
        self.models = models
        self.name = name or consumer_name()
        self.concurrency = settings.async_worker_concurrency
        self.visibility_ms = int(settings.async_visibility_timeout * 1000)
        self.max_attempts = settings.async_max_attempts
        self.ttl = settings.async_result_ttl
        self.inflight: dict[str, asyncio.Task] = {}
        self._slot_freed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set; then let running jobs finish (the caller bounds how long)."""
        while not self.models.loaded and not stop.is_set():  # noqa: ASYNC110 (load has no event to wait on)
            await asyncio.sleep(0.1)
        loops = [asyncio.create_task(self._consume(stop), name="asyncq-consume"),
                 asyncio.create_task(self._reclaim(stop), name="asyncq-reclaim"),
                 asyncio.create_task(self._heartbeat(stop), name="asyncq-heartbeat")]
        try:
            await stop.wait()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def drain(self, grace: float) -> None:
        """Wait for running jobs; what is left stays pending in Redis for another worker."""
        if self.inflight:
            _, pending = await asyncio.wait(list(self.inflight.values()), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # -- loops -------------------------------------------------------------------------------
    async def _free_slots(self) -> int:
        while len(self.inflight) >= self.concurrency:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        return self.concurrency - len(self.inflight)

    async def _consume(self, stop: asyncio.Event) -> None:
        await self._with_retry(self.store.ensure_groups)
        while not stop.is_set():
            free = await self._free_slots()
            try:
                batch = await self.store.read(self.store.keys.jobs, JOB_GROUP, self.name, free, 1000)
            except RedisError as exc:
                log.warning("reading jobs failed (%s); retrying", exc)
                await asyncio.sleep(1)
                continue
            for entry in batch:
                self._spawn(entry)

    async def _reclaim(self, stop: asyncio.Event) -> None:
        period = max(0.2, self.visibility_ms / 4000)
        while not stop.is_set():
            await asyncio.sleep(period)
            free = self.concurrency - len(self.inflight)
            if free <= 0:
                continue
            try:
                claimed = await self.store.reclaim(self.store.keys.jobs, JOB_GROUP, self.name,
                                                   self.visibility_ms, free)
            except RedisError as exc:
                log.warning("reclaiming jobs failed: %s", exc)
                continue
            for entry in claimed:
                if entry.entry_id not in self.inflight:
                    log.info("took over job %s left pending by a silent worker", entry.job_id)
                    self._spawn(entry)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        period = max(0.2, self.visibility_ms / 3000)
        while not stop.is_set():
            await asyncio.sleep(period)
            try:
                await self.store.touch(self.store.keys.jobs, JOB_GROUP, self.name, list(self.inflight))
            except RedisError as exc:
                log.warning("job heartbeat failed: %s", exc)

    @staticmethod
    async def _with_retry(step) -> None:
        while True:
            try:
                return await step()
            except RedisError as exc:
                log.warning("Redis not reachable yet (%s); retrying", exc)
                await asyncio.sleep(1)

    # -- one job -------------------------------------------------------------------------------
    def _spawn(self, entry: Entry) -> None:
        task = asyncio.create_task(self._process(entry), name=f"job-{entry.job_id}")
        self.inflight[entry.entry_id] = task

        def done(_: asyncio.Task) -> None:
            self.inflight.pop(entry.entry_id, None)
            self._slot_freed.set()

        task.add_done_callback(done)

    async def _process(self, entry: Entry) -> None:
        try:
            started = await self.store.start(entry.job_id, self.name)
            if started.state != "run":  # finished already, or expired: only the entry is left
                await self.store.ack(self.store.keys.jobs, JOB_GROUP, entry.entry_id)
                return
            if started.attempts > self.max_attempts:
                status, payload = "failed", (f"gave up after {self.max_attempts} attempts: the workers running "
                                             "this job stopped before finishing it").encode()
            else:
                status, payload = await self._execute(started.kind, started.request)
            outcome = await self.store.finish(entry, status, payload, self.ttl)
            if outcome == 0:
                log.info("job %s was already finished by another worker; dropped the duplicate", entry.job_id)
        except RedisError as exc:  # not acknowledged: the job stays pending and is claimed again
            log.warning("job %s: Redis failed (%s); it will be retried", entry.job_id, exc)

    async def _execute(self, kind: str, request: bytes) -> tuple[str, bytes]:
        spec = KINDS.get(kind)
        if spec is None:
            return "failed", f"unknown job kind {kind!r}".encode()
        try:
            return "succeeded", await spec.run(self.models, request)
        except PERMANENT as exc:
            return "failed", reason(exc).encode()
        except RedisError:
            raise
        except Exception as exc:  # the engine refused it: running it again would fail again
            log.exception("job failed in the engine")
            return "failed", f"engine error: {reason(exc)}".encode()
