"""The job worker: a consumer in the `workers` group of the jobs stream.

At-least-once: an entry is acknowledged only by `JobStore.finish`, in the same atomic step that
stores the result. If this process dies, its entries stay pending and any worker takes them over
with XAUTOCLAIM once they have been idle for the visibility timeout; while we still work on an
entry we reset its idle time (XCLAIM JUSTID), so a slow job is not run twice for nothing. When a
job does run twice, `finish` keeps the first result and drops the second.

A run that fails for a condition of the replica (see `failures.classify`: queue full, out of
memory, loading, draining) sends the job back: `queued` again after a growing backoff, in the same
atomic step that acknowledges the entry. Such a job is never marked failed, and its retries do not
count against `--async-max-attempts`, which bounds only runs that never came back (dead workers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from redis.exceptions import RedisError

from embedfleet.runtime.asyncq.failures import Failure, classify, reason, retry_after
from embedfleet.runtime.asyncq.keys import JOB_GROUP
from embedfleet.runtime.asyncq.kinds import KINDS
from embedfleet.runtime.asyncq.store import Entry, JobStore, Started
from embedfleet.runtime.asyncq.webhooks import retry_delay
from embedfleet.runtime.service import Models

log = logging.getLogger(__name__)

DRAINING = "draining: the worker stopped before finishing the job; it runs again on another worker"


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    def __init__(self, store: JobStore, models: Models, name: str | None = None, retry_backoff: float = 1.0,
                 retry_cap: float = 60.0) -> None:
        settings = models.settings
        self.store = store
        self.models = models
        self.name = name or consumer_name()
        self.concurrency = settings.async_worker_concurrency
        self.visibility_ms = int(settings.async_visibility_timeout * 1000)
        self.max_attempts = settings.async_max_attempts
        self.ttl = settings.async_result_ttl
        self.retry_backoff = retry_backoff  # first wait after a transient failure; doubles up to retry_cap
        self.retry_cap = retry_cap
        self.inflight: dict[str, asyncio.Task] = {}
        self._slot_freed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until `stop` is set; then let running jobs finish (the caller bounds how long)."""
        while not self.models.loaded and not stop.is_set():  # noqa: ASYNC110 (load has no event to wait on)
            await asyncio.sleep(0.1)
        loops = [asyncio.create_task(self._consume(stop), name="asyncq-consume"),
                 asyncio.create_task(self._reclaim(stop), name="asyncq-reclaim"),
                 asyncio.create_task(self._heartbeat(stop), name="asyncq-heartbeat"),
                 asyncio.create_task(self._release(stop), name="asyncq-release")]
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

    async def _release(self, stop: asyncio.Event) -> None:
        """Put jobs whose transient-failure backoff has passed back onto the stream (any worker may)."""
        while not stop.is_set():
            try:
                await self.store.release_due_jobs()
            except RedisError as exc:
                log.warning("moving due job retries failed: %s", exc)
            await asyncio.sleep(0.2)

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
        started: Started | None = None
        try:
            started = await self.store.start(entry.job_id, self.name)
            if started.state != "run":  # finished already, or expired: only the entry is left
                await self.store.ack(self.store.keys.jobs, JOB_GROUP, entry.entry_id)
                return
            if started.crashes > self.max_attempts:
                status, payload = "failed", (f"gave up after {self.max_attempts} attempts: the workers running "
                                             "this job stopped before finishing it").encode()
            else:
                try:
                    status, payload = "succeeded", await self._run(started)
                except RedisError:
                    raise
                except Exception as exc:
                    if classify(exc) is Failure.TRANSIENT:
                        delay = max(retry_after(exc), retry_delay(started.retries + 1, self.retry_backoff,
                                                                  self.retry_cap))
                        log.warning("job %s hit a transient condition (%s); queued again in %.1fs", entry.job_id,
                                    reason(exc), delay)
                        await self.store.retry(entry, delay, reason(exc))
                        return
                    if not isinstance(exc, ValueError):  # not bad input: worth a traceback
                        log.exception("job %s failed permanently", entry.job_id)
                    status, payload = "failed", reason(exc).encode()
            outcome = await self.store.finish(entry, status, payload, self.ttl)
            if outcome == 0:
                log.info("job %s was already finished by another worker; dropped the duplicate", entry.job_id)
        except asyncio.CancelledError:  # draining: hand the job back now rather than after the visibility timeout
            if started is not None and started.state == "run":
                await self._send_back_on_drain(entry)
            raise
        except RedisError as exc:  # not acknowledged: the job stays pending and is claimed again
            log.warning("job %s: Redis failed (%s); it will be retried", entry.job_id, exc)

    async def _send_back_on_drain(self, entry: Entry) -> None:
        """Queue a job cut off by shutdown for another worker at once; bounded, as the process is stopping."""
        try:
            await asyncio.wait_for(self.store.retry(entry, 0.0, DRAINING), timeout=2.0)
        except (RedisError, TimeoutError) as exc:  # still pending in the stream: reclaimed after the timeout
            log.warning("job %s could not be handed back while draining (%s)", entry.job_id, exc)

    async def _run(self, started: Started) -> bytes:
        spec = KINDS.get(started.kind)
        if spec is None:
            raise ValueError(f"unknown job kind {started.kind!r}")
        return await spec.run(self.models, started.request, self.models.tenants.job_owner(started.tenant))
