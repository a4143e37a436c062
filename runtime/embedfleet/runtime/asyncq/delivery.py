"""Webhook delivery: a consumer in the `senders` group of the webhook stream.

A delivery is acknowledged only together with its next state (delivered, scheduled for retry,
or dead-lettered), so a sender that dies mid-delivery leaves it pending for another to claim.
Retries wait in a sorted set until due (exponential backoff), then go back onto the stream.

A delivery is bounded three ways, since the receiver is untrusted: one deadline for the whole
attempt (`--webhook-timeout`, so a receiver that drips bytes cannot hold a sender), the response
read raw and only up to `RESPONSE_CAP` bytes (we need its status and an excerpt for the error, and a
huge or compressed body must not fill memory), and at most `MAX_TAKES` hand-overs of one stream
entry: an entry whose senders keep dying while delivering it is dead-lettered, not retried forever.
The connection goes to an address `resolve_webhook` checked, with the URL's host in `Host` and in
TLS SNI (so the certificate is still verified against the host name), and never through a proxy
from the environment or a pooled connection opened for another host name.
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
from embedfleet.runtime.asyncq.webhooks import WebhookRefused, resolve_webhook, retry_delay, signed_headers
from embedfleet.runtime.metrics import WEBHOOK_OUTCOMES, RuntimeMetrics
from embedfleet.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)

RESPONSE_CAP = 64 * 1024  # bytes of a receiver's response we read at most
MAX_TAKES = 3  # times one delivery entry may be handed to a sender before it is dead-lettered


async def read_capped(response: httpx.Response, cap: int = RESPONSE_CAP) -> bytes:
    """At most `cap` bytes of the body as sent (no decompression: a small gzip can expand to gigabytes)."""
    data = bytearray()
    async for chunk in response.aiter_raw():
        data += chunk[:cap - len(data)]
        if len(data) >= cap:
            break
    return bytes(data)


class WebhookSender:
    def __init__(self, store: JobStore, settings: RuntimeSettings, name: str,
                 metrics: RuntimeMetrics | None = None) -> None:
        self.store = store
        # every outcome exported from the start (at 0), so a rate or an alert on it has a series to read
        self.outcomes = {o: metrics.async_webhooks.labels(o) for o in WEBHOOK_OUTCOMES} if metrics else {}
        self.name = name
        self.secret = settings.webhook_secret.get_secret_value().encode() if settings.webhook_secret else b""
        self.allow_private = settings.webhook_allow_private
        self.max_attempts = settings.webhook_max_attempts
        self.backoff = settings.webhook_backoff
        self.timeout = settings.webhook_timeout
        self.idle_ms = int(max(settings.webhook_timeout * 3, 30) * 1000)
        self.concurrency = 32
        self.inflight: set[asyncio.Task] = set()

    def client(self) -> httpx.AsyncClient:
        """The HTTP client deliveries use.

        No keep-alive: a pooled connection is matched by address only and could carry a request for
        another host name over a TLS session verified for the first. No proxy from the environment:
        the connection must go to the address that was checked.
        """
        return httpx.AsyncClient(timeout=self.timeout, follow_redirects=False, trust_env=False,
                                 limits=httpx.Limits(max_keepalive_connections=0))

    async def run(self, stop: asyncio.Event) -> None:
        async with self.client() as client:
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
                    reclaimed = await self.store.reclaim(keys.webhooks, WEBHOOK_GROUP, self.name, self.idle_ms, free)
                    if reclaimed:
                        taken = await self.store.times_taken(keys.webhooks, WEBHOOK_GROUP,
                                                             [e.entry_id for e in reclaimed])
                        for entry in reclaimed:
                            entry.taken = taken.get(entry.entry_id, entry.taken)
                    batch += reclaimed
            except RedisError as exc:
                log.warning("reading webhook deliveries failed (%s); retrying", exc)
                await asyncio.sleep(1)
                continue
            for entry in batch:
                task = asyncio.create_task(self.deliver(client, entry))
                self.inflight.add(task)
                task.add_done_callback(self.inflight.discard)

    async def deliver(self, client: httpx.AsyncClient, entry: Entry) -> None:
        """One delivery entry to its next state: delivered, scheduled again, or dead-lettered."""
        try:
            job = await self.store.job(entry.job_id)
            url = text(job.get("webhook_url", b"")) if job else ""
            if not job or not url:
                await self.store.dead_letter(entry, url, "the job or its result expired before delivery",
                                             job_exists=bool(job))
                self._count("dead_lettered")
                return
            if entry.taken > MAX_TAKES:
                log.warning("webhook for job %s: senders stopped %d times while delivering it: dead-lettered",
                            entry.job_id, entry.taken - 1)
                await self.store.dead_letter(entry, url, f"handed to a sender {entry.taken} times without an "
                                             f"outcome (each sender stopped while delivering it; limit {MAX_TAKES})")
                self._count("dead_lettered")
                return
            error = await self.send(client, url, entry, job_document(entry.job_id, job))
            if error is None:
                await self.store.delivered(entry)
                self._count("delivered")
            elif entry.attempt >= self.max_attempts:
                log.warning("webhook for job %s failed %d times (%s): dead-lettered", entry.job_id, entry.attempt,
                            error)
                await self.store.dead_letter(entry, url, error)
                self._count("dead_lettered")
            else:
                await self.store.retry_later(entry, retry_delay(entry.attempt, self.backoff), error)
                self._count("retried")
        except RedisError as exc:  # left pending: another sender (or we) claims it later
            log.warning("webhook for job %s: Redis failed (%s)", entry.job_id, exc)

    def _count(self, outcome: str) -> None:
        """Counted after Redis took the next state, so a failed write is not counted as an outcome."""
        if outcome in self.outcomes:
            self.outcomes[outcome].inc()

    async def send(self, client: httpx.AsyncClient, url: str, entry: Entry, body: bytes) -> str | None:
        """One signed POST to a checked address of `url`: None when delivered, else why not."""
        if not self.secret:
            return "no --webhook-secret configured on this worker; refusing to send unsigned deliveries"
        try:
            target = await resolve_webhook(url, self.allow_private)
        except WebhookRefused as exc:
            return str(exc)
        original = httpx.URL(url)
        headers = {**signed_headers(self.secret, body, entry.job_id, entry.attempt),
                   "host": original.netloc.decode("ascii"), "accept-encoding": "identity"}
        extensions = {"sni_hostname": original.raw_host.decode("ascii")} if original.scheme == "https" else {}
        error = "no address to connect to"
        for address in target.addresses:  # the next address only when this one refused the connection
            try:
                async with asyncio.timeout(self.timeout):
                    async with client.stream("POST", original.copy_with(host=address), content=body,
                                             headers=headers, extensions=extensions) as response:
                        excerpt = await read_capped(response)
            except httpx.ConnectError as exc:
                error = f"ConnectError to {address}: {exc}"
                continue
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                return f"no complete answer within --webhook-timeout {self.timeout:g}s"
            if 200 <= response.status_code < 300:
                return None
            text_excerpt = excerpt[:200].decode("utf-8", errors="replace")
            return f"HTTP {response.status_code}: {orjson.dumps(text_excerpt).decode()}"
        return error
