"""Webhook delivery: a consumer in the `senders` group of the webhook stream.

A delivery is acknowledged only together with its next state (delivered, scheduled for retry,
or dead-lettered), so a sender that dies mid-delivery leaves it pending for another to claim.
Retries wait in a sorted set until due (exponential backoff), then go back onto the stream.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
from redis.exceptions import RedisError

from embedfleet.runtime.asyncq.keys import WEBHOOK_GROUP
from embedfleet.runtime.asyncq.status import job_document
from embedfleet.runtime.asyncq.store import Entry, JobStore, text
from embedfleet.runtime.asyncq.webhooks import WebhookRefused, check_webhook_url, retry_delay, signed_headers
from embedfleet.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)


class WebhookSender:
    def __init__(self, store: JobStore, settings: RuntimeSettings, name: str) -> None:
        self.store = store
        self.name = name
        self.secret = settings.webhook_secret.get_secret_value().encode() if settings.webhook_secret else b""
        self.allow_private = settings.webhook_allow_private
        self.max_attempts = settings.webhook_max_attempts
        self.backoff = settings.webhook_backoff
        self.timeout = settings.webhook_timeout
        self.idle_ms = int(max(settings.webhook_timeout * 3, 30) * 1000)
        self.concurrency = 32
        self.inflight: set[asyncio.Task] = set()

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=self.timeout, follow_redirects=False) as client:
            loops = [asyncio.create_task(self._consume(stop, client), name="webhook-consume"),
                     asyncio.create_task(self._release(stop), name="webhook-release")]
            try:
                await stop.wait()
            finally:
                for task in loops:
                    task.cancel()
                await asyncio.gather(*loops, return_exceptions=True)
                if self.inflight:
                    await asyncio.wait(self.inflight, timeout=self.timeout)

    async def _release(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.store.release_due()
            except RedisError as exc:
                log.warning("moving due webhook retries failed: %s", exc)
            await asyncio.sleep(0.2)

    async def _consume(self, stop: asyncio.Event, client: httpx.AsyncClient) -> None:
        keys = self.store.keys
        last_reclaim = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            free = self.concurrency - len(self.inflight)
            if free <= 0:
                await asyncio.wait(self.inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                batch = await self.store.read(keys.webhooks, WEBHOOK_GROUP, self.name, free, 500)
                if loop.time() - last_reclaim > self.idle_ms / 4000:
                    last_reclaim = loop.time()
                    batch += await self.store.reclaim(keys.webhooks, WEBHOOK_GROUP, self.name, self.idle_ms, free)
            except RedisError as exc:
                log.warning("reading webhook deliveries failed (%s); retrying", exc)
                await asyncio.sleep(1)
                continue
            for entry in batch:
                task = asyncio.create_task(self._deliver(client, entry))
                self.inflight.add(task)
                task.add_done_callback(self.inflight.discard)

    async def _deliver(self, client: httpx.AsyncClient, entry: Entry) -> None:
        try:
            job = await self.store.job(entry.job_id)
            url = text(job.get("webhook_url", b"")) if job else ""
            if not job or not url:
                await self.store.dead_letter(entry, url, "the job or its result expired before delivery",
                                             job_exists=bool(job))
                return
            error = await self._post(client, url, entry, job_document(entry.job_id, job))
            if error is None:
                await self.store.delivered(entry)
            elif entry.attempt >= self.max_attempts:
                log.warning("webhook for job %s failed %d times (%s): dead-lettered", entry.job_id, entry.attempt,
                            error)
                await self.store.dead_letter(entry, url, error)
            else:
                await self.store.retry_later(entry, retry_delay(entry.attempt, self.backoff), error)
        except RedisError as exc:  # left pending: another sender (or we) claims it later
            log.warning("webhook for job %s: Redis failed (%s)", entry.job_id, exc)

    async def _post(self, client: httpx.AsyncClient, url: str, entry: Entry, body: bytes) -> str | None:
        """None when delivered, else why not."""
        if not self.secret:
            return "no --webhook-secret configured on this worker; refusing to send unsigned deliveries"
        try:
            await check_webhook_url(url, self.allow_private)
        except WebhookRefused as exc:
            return str(exc)
        try:
            response = await client.post(url, content=body,
                                         headers=signed_headers(self.secret, body, entry.job_id, entry.attempt))
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if 200 <= response.status_code < 300:
            return None
        return f"HTTP {response.status_code}: {orjson.dumps(response.text[:200]).decode()}"
