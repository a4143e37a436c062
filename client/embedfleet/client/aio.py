"""The asynchronous client: one pooled aiohttp session, many batches in flight, retries, hedging.

aiohttp rather than httpx: on loopback with base64 bodies it moved ~4x more embeddings per second
per core than httpx's AsyncClient in our measurement (bench/client.py), and the client's own
overhead is the whole point of this module.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import aiohttp
import numpy as np
import orjson

from .batching import plan_batches
from .decode import Usage, decode_embeddings, error_details, load_json
from .endpoints import Endpoint, EndpointPool
from .errors import (
    BatchFailedError,
    ClientError,
    DeadlineExceeded,
    FailedBatch,
    InputError,
    ResponseMismatchError,
    ServerError,
    TransportError,
)
from .results import BatchTiming, CallStats, EmbedResult, Label, RerankHit, parse_classify, parse_rerank
from .retry import HedgeBudget, RetryPolicy, parse_retry_after

T = TypeVar("T")

_JSON = {"Content-Type": "application/json", "Accept": "application/json"}


class _DeadlineHit(ClientError):
    """A batch gave up because the call's deadline would pass before it could finish."""


@dataclass
class _Op(Generic[T]):
    """One kind of request: how to build a batch's body for an endpoint and parse its answer."""

    build: Callable[[int, int, Endpoint], tuple[str, bytes]]  # (start, stop, endpoint) -> (path, body)
    parse: Callable[[bytes, int, int], tuple[T, Usage]]  # (body, start, stop) -> result; may run in a thread
    fallback: Callable[[Endpoint, ServerError], bool] | None = None  # True: re-send at once (route changed)


def check_texts(texts: Sequence[str], what: str = "input") -> list[int]:
    """Character lengths of `texts`, refusing non-strings and empty strings by position."""
    if isinstance(texts, str):
        raise InputError(f"{what} must be a list of strings, not a single string")
    if all(type(t) is str for t in texts):  # fast path (C-level loops); the loop below names a bad input
        lengths = list(map(len, texts))
        if 0 not in lengths:
            return lengths
    lengths = []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"{what} {i} is {type(t).__name__}, not str")
        if not t:
            raise InputError(f"{what} {i} is an empty string")
        lengths.append(len(t))
    return lengths


class AsyncClient:
    """Embeds, reranks and classifies through one or more OpenAI/TEI-compatible endpoints.

    One instance holds one connection pool; share it. Settings given here are defaults that each
    call may override. `stats` accumulates usage, requests, retries and hedges over the lifetime.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        model: str | None = None,
        api_key: str | None = None,
        batch_size: int = 128,
        max_chars_per_request: int | None = 200_000,
        max_concurrent_requests: int = 64,
        request_timeout: float = 60.0,
        deadline: float | None = None,
        retry: RetryPolicy | None = None,
        hedge_delay: float | None = None,
        hedge_budget: float = 0.10,
        spread: bool = False,
        health_path: str = "/health",
        health_interval: float = 10.0,
        encoding_format: str = "base64",
        offload_bytes: int = 1 << 20,
        max_requests_total: int | None = None,
    ) -> None:
        if batch_size < 1 or max_concurrent_requests < 1:
            raise ValueError("batch_size and max_concurrent_requests must be >= 1")
        if encoding_format not in ("base64", "float"):
            raise ValueError("encoding_format must be 'base64' or 'float'")
        if max_requests_total is not None and max_requests_total < 1:
            raise ValueError("max_requests_total must be >= 1")
        self.pool = EndpointPool(urls, spread=spread)
        self.model = model
        self.batch_size = batch_size
        self.max_chars_per_request = max_chars_per_request
        self.max_concurrent_requests = max_concurrent_requests
        self.request_timeout = request_timeout
        self.deadline = deadline
        self.retry = retry or RetryPolicy()
        self.hedge_delay = hedge_delay
        self.hedge_budget = hedge_budget
        self.health_path = health_path
        self.health_interval = health_interval
        self.encoding_format = encoding_format
        self.offload_bytes = offload_bytes
        # Requests in flight over all concurrent calls together (None: only each call's own cap). The
        # backfill runs a few chunks' calls at once and still promises --max-concurrent-requests.
        self.max_requests_total = max_requests_total
        self._total_slots: asyncio.Semaphore | None = None
        self.stats = CallStats()
        self.request_errors = 0  # failed requests so far (retried or not), live, for progress displays
        self._headers = dict(_JSON)
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._last_probe: float | None = None
        self._probe_task: asyncio.Task[Any] | None = None

    # ----------------------------------------------------------------- session and health
    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and self._session_loop is not loop:
            # Used from a new event loop (e.g. a second asyncio.run): the old pool belongs to a dead loop.
            self._session = None
            self._total_slots = None
        if self._session is None or self._session.closed:
            self._session_loop = loop
            connector = aiohttp.TCPConnector(
                limit=max(self.max_concurrent_requests * 2, 16), limit_per_host=0, ttl_dns_cache=300
            )
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def check_health(self, probe_timeout: float = 2.0) -> dict[str, bool]:
        """Probe every endpoint's health route; records health and latency. Returns url -> healthy.

        A 404 counts as alive (an OpenAI-compatible server need not have a health route); 5xx,
        refused connections and timeouts do not.
        """
        session = self._get_session()

        async def probe(e: Endpoint) -> bool:
            t0 = time.perf_counter()
            try:
                async with session.get(
                    e.url + self.health_path, timeout=aiohttp.ClientTimeout(total=probe_timeout)
                ) as resp:
                    await resp.read()
                    ok = resp.status < 500
            except (aiohttp.ClientError, TimeoutError, OSError):
                ok = False
            self.pool.probed(e, ok, time.perf_counter() - t0 if ok else None)
            return ok

        results = await asyncio.gather(*(probe(e) for e in self.pool.endpoints))
        self._last_probe = time.monotonic()
        return {e.url: ok for e, ok in zip(self.pool.endpoints, results, strict=True)}

    async def _maybe_probe(self) -> None:
        """With several endpoints: probe before the first call, then in the background now and then."""
        if len(self.pool.endpoints) < 2:
            return
        if self._last_probe is None:
            await self.check_health()
        elif time.monotonic() - self._last_probe > self.health_interval and (
            self._probe_task is None or self._probe_task.done()
        ):
            self._last_probe = time.monotonic()
            self._probe_task = asyncio.get_running_loop().create_task(self.check_health())

    # ----------------------------------------------------------------- public calls
    async def embed(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        dimensions: int | None = None,
        encoding_format: str | None = None,
        batch_size: int | None = None,
        max_concurrent_requests: int | None = None,
        deadline: float | None = None,
    ) -> np.ndarray:
        """Embeddings as a `(len(texts), dim)` float32 array, rows in input order."""
        result = await self.embed_detailed(
            texts,
            model=model,
            dimensions=dimensions,
            encoding_format=encoding_format,
            batch_size=batch_size,
            max_concurrent_requests=max_concurrent_requests,
            deadline=deadline,
        )
        return result.embeddings

    async def embed_detailed(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        dimensions: int | None = None,
        encoding_format: str | None = None,
        batch_size: int | None = None,
        max_concurrent_requests: int | None = None,
        deadline: float | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> EmbedResult:
        """Like `embed`, plus this call's usage, request counts and per-batch timings.

        `on_batch(n)` is called on the event loop as each batch of `n` inputs completes (progress bars).
        """
        lengths = check_texts(texts)
        fmt = encoding_format or self.encoding_format
        if fmt not in ("base64", "float"):
            raise ValueError("encoding_format must be 'base64' or 'float'")
        model = model or self.model
        if not lengths:
            return EmbedResult(np.empty((0, dimensions or 0), dtype=np.float32), CallStats())
        texts = texts if isinstance(texts, list) else list(texts)

        def build(start: int, stop: int, _e: Endpoint) -> tuple[str, bytes]:
            payload: dict[str, Any] = {"input": texts[start:stop], "encoding_format": fmt}
            if model:
                payload["model"] = model
            if dimensions:
                payload["dimensions"] = dimensions
            return "/v1/embeddings", orjson.dumps(payload)

        total = len(lengths)
        sink: list[np.ndarray] = []  # the output, allocated once the first batch reveals the dimension
        sink_lock = threading.Lock()  # parse may run in a worker thread for large bodies

        def parse(body: bytes, start: int, stop: int) -> tuple[None, Usage]:
            rows, usage = decode_embeddings(body, stop - start, dimensions)
            with sink_lock:
                if not sink:
                    sink.append(np.empty((total, rows.shape[1]), dtype=np.float32))
            out = sink[0]
            if rows.shape[1] != out.shape[1]:
                raise ResponseMismatchError(
                    f"dimension {rows.shape[1]} differs from earlier batches' {out.shape[1]}"
                )
            out[start:stop] = rows  # straight from the decoded bytes into the caller's array
            return None, usage

        ranges = plan_batches(lengths, batch_size or self.batch_size, self.max_chars_per_request)
        _, stats = await self._run(
            _Op(build, parse), ranges, total, deadline, max_concurrent_requests, on_batch
        )
        out = sink[0]
        return EmbedResult(out, stats)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        raw_scores: bool = False,
        return_text: bool = False,
        truncate: bool | None = None,
        top_n: int | None = None,
        batch_size: int | None = None,
        deadline: float | None = None,
    ) -> list[RerankHit]:
        """Documents scored against `query`, best first; `index` refers to `documents`."""
        if not isinstance(query, str) or not query:
            raise InputError("query must be a non-empty string")
        lengths = check_texts(documents, "document")
        docs = list(documents)

        def build(start: int, stop: int, _e: Endpoint) -> tuple[str, bytes]:
            payload: dict[str, Any] = {"query": query, "texts": docs[start:stop], "raw_scores": raw_scores}
            if return_text:
                payload["return_text"] = True
            if truncate is not None:
                payload["truncate"] = truncate
            return "/rerank", orjson.dumps(payload)

        def parse(body: bytes, start: int, stop: int) -> tuple[list[RerankHit], Usage]:
            return parse_rerank(load_json(body), stop - start, start), Usage()

        ranges = plan_batches(lengths, batch_size or self.batch_size, self.max_chars_per_request)
        parts, _ = await self._run(_Op(build, parse), ranges, len(lengths), deadline, None)
        hits = sorted((h for part in parts for h in part), key=lambda h: (-h.score, h.index))
        return hits[:top_n] if top_n is not None else hits

    async def classify(
        self,
        texts: Sequence[str],
        *,
        model: str | None = None,
        batch_size: int | None = None,
        deadline: float | None = None,
    ) -> list[list[Label]]:
        """Labels per input (best first), in input order. Uses `/classify`, or TEI's `/predict`."""
        lengths = check_texts(texts)
        items = list(texts)
        model = model or self.model

        def build(start: int, stop: int, e: Endpoint) -> tuple[str, bytes]:
            if e.extra.get("classify") == "predict":
                return "/predict", orjson.dumps({"inputs": items[start:stop]})
            payload: dict[str, Any] = {"input": items[start:stop]}
            if model:
                payload["model"] = model
            return "/classify", orjson.dumps(payload)

        def parse(body: bytes, start: int, stop: int) -> tuple[list[list[Label]], Usage]:
            doc = load_json(body)
            return parse_classify(doc, stop - start), Usage()

        def fallback(e: Endpoint, err: ServerError) -> bool:
            # Concurrent batches may all hit /classify before the first 404 switches the route.
            if err.status in (404, 405) and err.url.endswith("/classify"):
                e.extra["classify"] = "predict"
                return True
            return False

        ranges = plan_batches(lengths, batch_size or self.batch_size, self.max_chars_per_request)
        parts, _ = await self._run(_Op(build, parse, fallback), ranges, len(lengths), deadline, None)
        return [row for part in parts for row in part]

    # ----------------------------------------------------------------- machinery
    async def _run(
        self,
        op: _Op[T],
        ranges: list[tuple[int, int]],
        total: int,
        deadline: float | None,
        concurrency: int | None,
        on_batch: Callable[[int], None] | None = None,
    ) -> tuple[list[T], CallStats]:
        """Run every batch with at most `concurrency` in flight; all results, or one error naming failures."""
        await self._maybe_probe()
        loop = asyncio.get_running_loop()
        deadline = self.deadline if deadline is None else deadline
        end = None if deadline is None else loop.time() + deadline
        stats = CallStats()
        budget = HedgeBudget(self.hedge_budget)
        results: list[T | None] = [None] * len(ranges)
        done_flags = [False] * len(ranges)
        failures: list[FailedBatch] = []
        queue = iter(enumerate(ranges))

        self._get_session()  # binds the session and the client-wide slots to this loop
        if self.max_requests_total is not None and self._total_slots is None:
            self._total_slots = asyncio.Semaphore(self.max_requests_total)
        total_slots = self._total_slots

        async def worker() -> None:
            for i, (start, stop) in queue:
                try:
                    if total_slots is None:
                        results[i] = await self._batch(op, start, stop, stats, budget, end)
                    else:
                        async with total_slots:
                            results[i] = await self._batch(op, start, stop, stats, budget, end)
                    done_flags[i] = True
                    if on_batch is not None:
                        on_batch(stop - start)
                except Exception as exc:  # any failure is reported by range, never dropped silently
                    failures.append(FailedBatch(start, stop, exc))

        n_workers = min(concurrency or self.max_concurrent_requests, len(ranges))
        workers = [loop.create_task(worker()) for _ in range(n_workers)]
        timed_out = False
        try:
            timeout = None if end is None else max(0.0, end - loop.time())
            _, pending = await asyncio.wait(workers, timeout=timeout)
            if pending:
                timed_out = True
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self.stats.merge(stats)
        if timed_out or any(isinstance(f.error, _DeadlineHit) for f in failures):
            failed_ranges = {(f.start, f.stop) for f in failures}
            for i, (start, stop) in enumerate(ranges):
                if not done_flags[i] and (start, stop) not in failed_ranges:
                    failures.append(FailedBatch(start, stop, _DeadlineHit(f"deadline of {deadline}s passed")))
            raise DeadlineExceeded(failures, total)
        if failures:
            raise BatchFailedError(failures, total)
        missing = [
            FailedBatch(s, e, ClientError("batch did not complete"))
            for (s, e), ok in zip(ranges, done_flags, strict=True)
            if not ok
        ]
        if missing:
            raise BatchFailedError(missing, total)
        return cast(list[T], results), stats

    async def _batch(
        self, op: _Op[T], start: int, stop: int, stats: CallStats, budget: HedgeBudget, end: float | None
    ) -> T:
        """One batch to completion: retries with backoff, failover to other endpoints, optional hedge."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        attempt = 0
        exclude: list[str] = []
        while True:
            remaining = None if end is None else end - loop.time()
            if remaining is not None and remaining <= 0:
                raise _DeadlineHit("deadline passed before the batch could be sent")
            try:
                result, usage, url, hedged = await self._attempt(
                    op, start, stop, stats, budget, remaining, exclude
                )
            except (TransportError, ServerError) as exc:
                base = getattr(exc, "endpoint_url", None)
                endpoint = next((e for e in self.pool.endpoints if e.url == base), None)
                if isinstance(exc, ServerError):
                    if op.fallback is not None and endpoint is not None and op.fallback(endpoint, exc):
                        continue
                    if not exc.retryable:
                        raise
                if attempt >= self.retry.max_retries:
                    raise
                exclude = [endpoint.url] if endpoint is not None else []
                others = [e for e in self.pool.endpoints if e.url not in exclude and e.healthy]
                retry_after = exc.retry_after if isinstance(exc, ServerError) else None
                # Failing over to another healthy endpoint needs no pause: backoff protects the failed one.
                delay = 0.0 if others else self.retry.delay(attempt, retry_after)
                if end is not None and loop.time() + delay >= end:
                    raise _DeadlineHit(f"deadline would pass before the next retry ({exc})") from exc
                attempt += 1
                stats.retries += 1
                if delay:
                    await asyncio.sleep(delay)
                continue
            stats.usage.add(usage)
            stats.batches.append(BatchTiming(start, stop, loop.time() - t0, url, attempt + 1, hedged))
            return result

    async def _attempt(
        self,
        op: _Op[T],
        start: int,
        stop: int,
        stats: CallStats,
        budget: HedgeBudget,
        remaining: float | None,
        exclude: list[str],
    ) -> tuple[T, Usage, str, bool]:
        """Send once; if still unanswered after `hedge_delay` and the budget allows, race a second copy."""
        timeout = self.request_timeout if remaining is None else min(self.request_timeout, remaining)
        endpoint = self.pool.choose(exclude)
        budget.record_primary()
        stats.requests += 1
        primary = asyncio.ensure_future(self._send(op, endpoint, start, stop, timeout))
        if self.hedge_delay is None:
            return await primary
        tasks: set[asyncio.Future[tuple[T, Usage, str, bool]]] = {primary}
        try:
            done, _ = await asyncio.wait(tasks, timeout=min(self.hedge_delay, timeout))
            if not done and budget.try_acquire():
                second = self.pool.choose([*exclude, endpoint.url])
                stats.hedges += 1
                stats.requests += 1
                hedge_timeout = timeout - self.hedge_delay
                tasks.add(
                    asyncio.ensure_future(self._send(op, second, start, stop, hedge_timeout, hedge=True))
                )
            error: BaseException | None = None
            while tasks:
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        return task.result()
                    error = task.exception()
            assert error is not None
            raise error
        finally:
            for task in tasks:
                task.cancel()

    async def _send(
        self, op: _Op[T], endpoint: Endpoint, start: int, stop: int, time_limit: float, hedge: bool = False
    ) -> tuple[T, Usage, str, bool]:
        path, body = op.build(start, stop, endpoint)
        url = endpoint.url + path
        session = self._get_session()
        self.pool.started(endpoint)
        t0 = time.perf_counter()
        try:
            async with session.post(
                url, data=body, timeout=aiohttp.ClientTimeout(total=max(time_limit, 0.001))
            ) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = resp.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.request_errors += 1
            self.pool.failure(endpoint, hard=not isinstance(exc, TimeoutError))
            err = TransportError(f"{url}: {type(exc).__name__}: {exc}".rstrip(": "))
            err.url = url  # type: ignore[attr-defined]
            err.endpoint_url = endpoint.url  # type: ignore[attr-defined]
            raise err from exc
        finally:
            self.pool.finished(endpoint)
        latency = time.perf_counter() - t0
        if status >= 400:
            self.request_errors += 1
            message, error_type, code = error_details(raw)
            err2 = ServerError(
                status,
                message,
                error_type=error_type,
                code=code,
                retry_after=parse_retry_after(retry_after),
                url=url,
            )
            err2.endpoint_url = endpoint.url  # type: ignore[attr-defined]
            if err2.retryable:
                self.pool.failure(endpoint, hard=False)
            raise err2
        self.pool.success(endpoint, latency)
        try:
            if len(raw) >= self.offload_bytes:
                # Big bodies decode in a thread so the loop keeps feeding other requests meanwhile.
                result, usage = await asyncio.get_running_loop().run_in_executor(
                    None, op.parse, raw, start, stop
                )
            else:
                result, usage = op.parse(raw, start, stop)
        except ResponseMismatchError as exc:
            raise ResponseMismatchError(f"{url}: {exc}") from None
        return result, usage, url, hedge


__all__ = ["AsyncClient", "DeadlineExceeded", "Label", "RerankHit"]
