"""The synchronous client: the async client driven from a private event-loop thread.

A private loop (rather than `asyncio.run` per call) keeps one connection pool alive across calls
and works from code that already runs inside someone else's event loop (notebooks, web handlers).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from .aio import AsyncClient
from .results import CallStats, EmbedResult, Label, RerankHit

T = TypeVar("T")


class Client:
    """Blocking twin of `AsyncClient`; takes the same arguments. Use as a context manager or `close()`."""

    def __init__(self, urls: str | Sequence[str], **settings: Any) -> None:
        self._aio = AsyncClient(urls, **settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="embedfleet-client", daemon=True)
        self._thread.start()
        self._closed = False

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            # Ctrl-C (or any exit) while waiting: stop the in-flight requests too, not just our wait.
            future.cancel()
            raise

    @property
    def stats(self) -> CallStats:
        return self._aio.stats

    @property
    def aio(self) -> AsyncClient:
        return self._aio

    def embed(self, texts: Sequence[str], **kwargs: Any) -> np.ndarray:
        return self._call(self._aio.embed(texts, **kwargs))

    def embed_detailed(self, texts: Sequence[str], **kwargs: Any) -> EmbedResult:
        return self._call(self._aio.embed_detailed(texts, **kwargs))

    def rerank(self, query: str, documents: Sequence[str], **kwargs: Any) -> list[RerankHit]:
        return self._call(self._aio.rerank(query, documents, **kwargs))

    def classify(self, texts: Sequence[str], **kwargs: Any) -> list[list[Label]]:
        return self._call(self._aio.classify(texts, **kwargs))

    def check_health(self) -> dict[str, bool]:
        return self._call(self._aio.check_health())

    def close(self) -> None:
        if self._closed:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._aio.close(), self._loop).result(timeout=10)
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
