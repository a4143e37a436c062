"""The embedding service of one model: tokenizer pool + batch manager + engine, and their state.

Routes call `embed()`; everything between the HTTP layer and the engine is here, so a second
front-end (the async Redis worker) reuses the same path.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import numpy as np

from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.core.tokenize import Direction, Tokenized, TokenizerPool
from embedfleet.runtime.engines.base import Engine
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.models.spec import ModelSpec, load_spec
from embedfleet.runtime.settings import RuntimeSettings

log = logging.getLogger(__name__)


@dataclass
class EmbedResult:
    vectors: np.ndarray  # pooled, unnormalised, input order
    tokens: int


def build_engine(settings: RuntimeSettings, spec: ModelSpec) -> Engine:
    if settings.engine == "trtllm":
        from embedfleet.runtime.engines.trtllm_engine import TrtLlmEngine

        return TrtLlmEngine(spec, settings)
    from embedfleet.runtime.engines.torch_engine import TorchEngine

    return TorchEngine(spec, device=settings.device, dtype=settings.dtype,
                       num_threads=settings.num_threads or settings.cores())


class EmbeddingService:
    def __init__(self, settings: RuntimeSettings, metrics: RuntimeMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.spec: ModelSpec | None = None
        self.engine: Engine | None = None
        self.tokenizer: TokenizerPool | None = None
        self.batcher: BatchManager | None = None
        self.load_error: str | None = None
        self.vector_cache = None  # set by embedfleet.runtime.asyncq when --cache-enabled
        self.created = int(time.time())

    @property
    def loaded(self) -> bool:
        return self.batcher is not None

    @property
    def input_limit(self) -> int:
        assert self.spec is not None
        limit = self.spec.max_length
        if self.settings.max_input_tokens:
            limit = min(limit, self.settings.max_input_tokens)
        return min(limit, self.settings.max_batch_tokens)

    def served_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        return "all-MiniLM-L6-v2" if self.settings.model is None else self.settings.model_dir().name

    async def load(self) -> None:
        """Load off the event loop so /health answers (and /ready says no) while weights load."""
        try:
            spec = load_spec(self.settings.model_dir(), self.served_name())
            engine = await asyncio.to_thread(build_engine, self.settings, spec)
            await asyncio.to_thread(getattr(engine, "warmup", lambda: None))
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("model failed to load: %s", self.load_error)
            raise
        self.spec, self.engine = spec, engine
        self.tokenizer = TokenizerPool(spec.path / "tokenizer.json", self.settings.tokenizer_workers
                                       or self.settings.cores())
        batcher = BatchManager(engine.embed, self.settings.max_batch_tokens, self.settings.max_batch_requests,
                               self.settings.max_queue_tokens, self.metrics)
        batcher.start()
        self.batcher = batcher
        log.info("serving %s (%s, pooling=%s, max_tokens=%d, dim=%d) on %s/%s", spec.name, spec.model_type,
                 spec.pooling, self.input_limit, spec.hidden_size, self.settings.device, self.settings.dtype)

    async def close(self) -> None:
        if self.batcher:
            await self.batcher.stop()
        if self.tokenizer:
            self.tokenizer.close()

    async def tokenize(self, inputs: Sequence[str] | Sequence[list[int]], truncate: bool,
                       direction: Direction) -> list[Tokenized]:
        assert self.tokenizer is not None
        if inputs and isinstance(inputs[0], str):
            return await self.tokenizer.encode(list(inputs), self.input_limit, truncate, direction)
        return TokenizerPool.from_ids(list(inputs), self.input_limit, truncate, direction)

    async def embed(self, tokenized: list[Tokenized], disconnected: Awaitable[None] | None = None,
                    urgent: bool | None = None) -> EmbedResult:
        """Run tokenized inputs through the batch manager; give up (and free the queue) if the client goes.

        `urgent=False` is how async jobs yield to sync traffic; None decides by request size.
        """
        assert self.batcher is not None
        truncated = sum(t.truncated for t in tokenized)
        if truncated:
            self.metrics.truncated.inc(truncated)
        if urgent is None:
            urgent = len(tokenized) <= self.settings.urgent_max_inputs
        if self.vector_cache is not None:  # asyncq.cache: rows it already knows skip the engine
            vectors = await self.vector_cache.through(
                self.spec.digest, tokenized, lambda todo: self._rows(todo, urgent, disconnected))
            if inspect.iscoroutine(disconnected) and inspect.getcoroutinestate(disconnected) == "CORO_CREATED":
                disconnected.close()  # all rows were cached: the disconnect watcher never ran
        else:
            vectors = await self._rows(tokenized, urgent, disconnected)
        return EmbedResult(vectors, sum(len(t.ids) for t in tokenized))

    async def _rows(self, tokenized: list[Tokenized], urgent: bool,
                    disconnected: Awaitable[None] | None) -> np.ndarray:
        job = self.batcher.submit([t.ids for t in tokenized], urgent=urgent)
        if disconnected is None:
            vectors = await job.future
        else:
            watcher = asyncio.ensure_future(disconnected)
            try:
                done, _ = await asyncio.wait({job.future, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
            if job.future not in done:
                self.batcher.cancel(job)
                raise ClientGone()
            vectors = job.future.result()
        return vectors


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""
