"""The job store: every state change of a job is one atomic Redis step (a Lua script or MULTI).

Invariants the scripts keep, whatever crashes in between:
- a job is accepted only together with its stream entry and its place in `unfinished` (no lost job);
- a result is written once: the first `finish` wins, later ones only acknowledge (no double result,
  no double webhook); acknowledging happens in the same step as storing, never before;
- a job sent back by a transient failure (`retry`) leaves the stream in the same step that puts it in
  `jobs_delayed`, and `release_due_jobs` moves it back onto the stream in one step: it is always in
  exactly one of the two, and it never stops being `unfinished`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from embedfleet.runtime.asyncq.keys import JOB_GROUP, WEBHOOK_GROUP, Keys

FINAL = ("succeeded", "failed")

SUBMIT = """
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], 'status', 'queued', 'kind', ARGV[4], 'request', ARGV[5], 'webhook_url', ARGV[6],
           'created_at', ARGV[3], 'attempts', 0, 'tenant', ARGV[7])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('XADD', KEYS[3], '*', 'id', ARGV[1])
return 1
"""

START = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {'gone'} end
if st == 'succeeded' or st == 'failed' then return {'done'} end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'kind', 'request', 'retries', 'tenant')
return {'run', tostring(n), f[1], f[2], f[3] or '0', f[4] or ''}
"""

RETRY = """
local st = redis.call('HGET', KEYS[1], 'status')
redis.call('XACK', KEYS[2], ARGV[5], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
if not st then
  redis.call('ZREM', KEYS[4], ARGV[1])
  return -1
end
if st == 'succeeded' or st == 'failed' then return 0 end
redis.call('HINCRBY', KEYS[1], 'retries', 1)
redis.call('HSET', KEYS[1], 'status', 'queued', 'retry_reason', ARGV[4], 'retry_at', ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
return 1
"""

RELEASE_DUE_JOBS = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, m in ipairs(due) do
  redis.call('ZREM', KEYS[1], m)
  redis.call('XADD', KEYS[2], '*', 'id', m)
end
return #due
"""

FINISH = """
local st = redis.call('HGET', KEYS[1], 'status')
redis.call('XACK', KEYS[2], ARGV[7], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
if not st then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return -1
end
if st == 'succeeded' or st == 'failed' then
  redis.call('HINCRBY', KEYS[5], 'duplicates', 1)
  return 0
end
local field = 'result'
if ARGV[3] == 'failed' then field = 'error' end
redis.call('HSET', KEYS[1], 'status', ARGV[3], field, ARGV[4], 'finished_at', ARGV[5])
redis.call('HDEL', KEYS[1], 'request')
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[3], 1)
local hook = redis.call('HGET', KEYS[1], 'webhook_url')
if hook and hook ~= '' then
  redis.call('HSET', KEYS[1], 'webhook_status', 'pending')
  redis.call('XADD', KEYS[4], '*', 'id', ARGV[1], 'attempt', 1)
end
return 1
"""

RELEASE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, m in ipairs(due) do
  redis.call('ZREM', KEYS[1], m)
  local sep = string.find(m, ':', 1, true)
  redis.call('XADD', KEYS[2], '*', 'id', string.sub(m, 1, sep - 1), 'attempt', string.sub(m, sep + 1))
end
return #due
"""


def connect(url: str) -> Redis:
    """A client that rides out a Redis restart: commands retry with backoff on connection errors."""
    return Redis.from_url(
        url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=[RedisConnectionError, RedisTimeoutError], health_check_interval=15,
        socket_connect_timeout=5)


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Started:
    state: str  # run | done | gone
    attempts: int = 0
    kind: str = ""
    request: bytes = b""
    retries: int = 0  # times a transient failure sent the job back; they do not count against max attempts
    tenant: str = ""  # who submitted it: its quota, priority and fair share apply when it runs

    @property
    def crashes(self) -> int:
        """Starts that ended neither in a result nor in a retry: the workers running it stopped."""
        return self.attempts - self.retries


@dataclass
class Entry:
    entry_id: str
    job_id: str
    attempt: int = 1
    taken: int = 1  # times the stream handed this entry to a consumer (known after a reclaim; 1 otherwise)


def entries(messages: list) -> list[Entry]:
    out = []
    for entry_id, fields in messages:
        if not fields:  # claimed but its stream entry was deleted (a finished job): nothing to run
            continue
        out.append(Entry(text(entry_id), text(fields[b"id"]), int(fields.get(b"attempt", b"1"))))
    return out


class JobStore:
    def __init__(self, redis: Redis, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._submit = redis.register_script(SUBMIT)
        self._start = redis.register_script(START)
        self._finish = redis.register_script(FINISH)
        self._retry = redis.register_script(RETRY)
        self._release = redis.register_script(RELEASE_DUE)
        self._release_jobs = redis.register_script(RELEASE_DUE_JOBS)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ensure_groups(self) -> None:
        """Create the consumer groups (idempotent); also after a Redis that lost its data."""
        for stream, group in ((self.keys.jobs, JOB_GROUP), (self.keys.webhooks, WEBHOOK_GROUP)):
            try:
                await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- submission and status ---------------------------------------------------------------
    async def submit(self, kind: str, request: bytes, webhook_url: str | None, max_depth: int,
                     tenant: str = "") -> str | None:
        """The new job's id, or None when `max_depth` jobs are already unfinished. `tenant` owns it: only
        that tenant may read it back."""
        job_id = uuid.uuid4().hex
        accepted = await self._submit(
            keys=[self.keys.unfinished, self.keys.job(job_id), self.keys.jobs],
            args=[job_id, max_depth, f"{time.time():.6f}", kind, request, webhook_url or "", tenant])
        return job_id if accepted == 1 else None

    async def job(self, job_id: str) -> dict[str, bytes] | None:
        fields = await self.redis.hgetall(self.keys.job(job_id))
        return {text(k): v for k, v in fields.items()} if fields else None

    async def depth(self) -> tuple[int, float]:
        """(unfinished jobs, age in seconds of the oldest)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self.keys.unfinished)
            pipe.zrange(self.keys.unfinished, 0, 0, withscores=True)
            count, oldest = await pipe.execute()
        age = max(0.0, time.time() - oldest[0][1]) if oldest else 0.0
        return int(count), age

    async def stats(self) -> dict[str, int]:
        return {text(k): int(v) for k, v in (await self.redis.hgetall(self.keys.stats)).items()}

    # -- workers --------------------------------------------------------------------------------
    async def read(self, stream: str, group: str, consumer: str, count: int, block_ms: int) -> list[Entry]:
        try:
            reply = await self.redis.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.ensure_groups()
            return []
        return [e for _, messages in reply or [] for e in entries(messages)]

    async def reclaim(self, stream: str, group: str, consumer: str, idle_ms: int, count: int) -> list[Entry]:
        """Entries left pending longer than `idle_ms` by a consumer that stopped (XAUTOCLAIM)."""
        reply = await self.redis.xautoclaim(stream, group, consumer, idle_ms, "0-0", count=count)
        return entries(reply[1])

    async def touch(self, stream: str, group: str, consumer: str, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this consumer still works on, so nobody claims them."""
        if entry_ids:
            await self.redis.xclaim(stream, group, consumer, 0, entry_ids, justid=True)

    async def ack(self, stream: str, group: str, entry_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(stream, group, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def start(self, job_id: str, worker: str) -> Started:
        reply = await self._start(keys=[self.keys.job(job_id)], args=[f"{time.time():.6f}", worker])
        state = text(reply[0])
        if state != "run":
            return Started(state)
        return Started(state, int(reply[1]), text(reply[2]), reply[3] or b"", int(reply[4]),
                       text(reply[5]) if len(reply) > 5 else "")

    async def finish(self, entry: Entry, status: str, payload: bytes, ttl: int) -> int:
        """1: stored; 0: a result was already there (duplicate dropped); -1: the job expired."""
        assert status in FINAL
        return int(await self._finish(
            keys=[self.keys.job(entry.job_id), self.keys.jobs, self.keys.unfinished, self.keys.webhooks,
                  self.keys.stats],
            args=[entry.job_id, entry.entry_id, status, payload, f"{time.time():.6f}", ttl, JOB_GROUP]))

    async def retry(self, entry: Entry, delay: float, why: str) -> int:
        """Send a job back for a transient failure: queued again after `delay` s, never failed.

        1: scheduled; 0: another run already finished it (nothing to do); -1: the job is gone.
        """
        return int(await self._retry(
            keys=[self.keys.job(entry.job_id), self.keys.jobs, self.keys.jobs_delayed, self.keys.unfinished],
            args=[entry.job_id, entry.entry_id, f"{time.time() + delay:.6f}", why, JOB_GROUP]))

    async def release_due_jobs(self, limit: int = 100) -> int:
        """Move jobs whose retry backoff has passed back onto the jobs stream."""
        return int(await self._release_jobs(keys=[self.keys.jobs_delayed, self.keys.jobs],
                                            args=[f"{time.time():.6f}", limit]))

    async def times_taken(self, stream: str, group: str, entry_ids: list[str]) -> dict[str, int]:
        """How often each pending entry was handed to a consumer (read once, plus every reclaim)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in entry_ids:
                pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
            replies = await pipe.execute()
        return {text(row["message_id"]): int(row["times_delivered"]) for reply in replies for row in reply}

    # -- webhooks -----------------------------------------------------------------------------------
    async def delivered(self, entry: Entry) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.job(entry.job_id), mapping={"webhook_status": "delivered",
                                                             "webhook_attempts": entry.attempt})
            pipe.xack(self.keys.webhooks, WEBHOOK_GROUP, entry.entry_id)
            pipe.xdel(self.keys.webhooks, entry.entry_id)
            await pipe.execute()

    async def retry_later(self, entry: Entry, delay: float, error: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zadd(self.keys.webhooks_delayed, {f"{entry.job_id}:{entry.attempt + 1}": time.time() + delay})
            pipe.hset(self.keys.job(entry.job_id), mapping={"webhook_attempts": entry.attempt,
                                                             "webhook_error": error})
            pipe.xack(self.keys.webhooks, WEBHOOK_GROUP, entry.entry_id)
            pipe.xdel(self.keys.webhooks, entry.entry_id)
            await pipe.execute()

    async def dead_letter(self, entry: Entry, url: str, error: str, job_exists: bool = True) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.dead_letters, {"id": entry.job_id, "webhook_url": url, "attempts": entry.attempt,
                                               "error": error, "failed_at": f"{time.time():.3f}"})
            if job_exists:  # never recreate an expired job as a hash without a TTL
                pipe.hset(self.keys.job(entry.job_id), mapping={"webhook_status": "dead",
                                                                 "webhook_attempts": entry.attempt,
                                                                 "webhook_error": error})
            pipe.xack(self.keys.webhooks, WEBHOOK_GROUP, entry.entry_id)
            pipe.xdel(self.keys.webhooks, entry.entry_id)
            await pipe.execute()

    async def release_due(self, limit: int = 100) -> int:
        """Move webhook retries whose backoff has passed back onto the delivery stream."""
        return int(await self._release(keys=[self.keys.webhooks_delayed, self.keys.webhooks],
                                       args=[f"{time.time():.6f}", limit]))

    # -- dead letters (operator tooling) -----------------------------------------------------------
    async def dead_letter_count(self) -> int:
        """Entries in the dead-letter stream (a gauge and an alert read it)."""
        return int(await self.redis.xlen(self.keys.dead_letters))

    async def dead_letters(self, count: int = 100) -> list[tuple[str, dict[str, str]]]:
        reply = await self.redis.xrange(self.keys.dead_letters, count=count)
        return [(text(i), {text(k): text(v) for k, v in f.items()}) for i, f in reply]

    async def replay(self, dlq_id: str, job_id: str) -> None:
        """Give a dead letter a fresh round of delivery attempts; atomic, so it is never in neither place."""
        exists = await self.redis.exists(self.keys.job(job_id))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.keys.webhooks, {"id": job_id, "attempt": 1})
            if exists:
                pipe.hset(self.keys.job(job_id), "webhook_status", "pending")
            pipe.xdel(self.keys.dead_letters, dlq_id)
            await pipe.execute()
