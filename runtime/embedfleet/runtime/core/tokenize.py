"""Tokenization off the event loop.

HF `tokenizers` releases the GIL and parallelises `encode_batch` itself, so a small thread pool
is enough to keep the event loop free and all cores busy. Batches are encoded with `encode_batch_fast`,
which skips the character offsets nobody on the embedding path reads: ~20 % less tokenizer CPU on
prose (the same ids, special-token masks and segments; `details` still needs the offsets). A lone
text keeps `encode`, which has no batch dispatch to pay for. Truncation is done here, not by the
tokenizer's own setting, because we must know each input's full length (to refuse it when the
client asked for no truncation) and must keep the model's special tokens at both ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenizers import Encoding, Tokenizer

from embedfleet.runtime.core.engine_thread import name_os_thread

Direction = Literal["right", "left"]


INLINE_CHARS = 512  # a lone text this short is tokenized on the event loop (see encode)
MERGE_TEXTS = 256  # at most this many texts of queued calls are tokenized in one batch (see encode)
MERGE_CHARS = 131_072  # and at most this many characters: a few tens of ms of one core's tokenizing


def _answer(answers: list[tuple[asyncio.Future, list | None, BaseException | None]]) -> None:
    """On the event loop: complete the futures of calls tokenized together (a caller that left is skipped)."""
    for future, result, error in answers:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class InputTooLong(ValueError):
    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"input {index} has {tokens} tokens, more than the limit of {limit}; "
            "shorten it or allow truncation")
        self.index, self.tokens, self.limit = index, tokens, limit


class TooManyTokens(ValueError):
    """A /tokenize request whose answer would be over the cap: one JSON object per token, with its
    text and offsets, is ~30x the input's bytes, so the cap bounds the response, not the work."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(
            f"the inputs have {tokens} tokens in all, more than the limit of {limit} tokens per /tokenize "
            "request; send fewer or shorter inputs")
        self.tokens, self.limit = tokens, limit


@dataclass(frozen=True, slots=True)
class Tokenized:
    """One engine input. `type_ids` only for pairs (query, document) on models that use segments."""

    ids: list[int]
    original_length: int
    type_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def truncated(self) -> bool:
        return len(self.ids) < self.original_length


def truncate_pair(enc: Encoding, limit: int, direction: Direction) -> tuple[list[int], list[int]]:
    """Shorten the document (second sequence) first, the query only if the document is gone."""
    ids, types, seqs = list(enc.ids), list(enc.type_ids), list(enc.sequence_ids)
    excess = len(ids) - limit
    for target in (1, 0):
        positions = [i for i, s in enumerate(seqs) if s == target]
        take = min(excess, len(positions))
        drop = set(positions[:take] if direction == "left" else positions[len(positions) - take:])
        if drop:
            ids = [t for i, t in enumerate(ids) if i not in drop]
            types = [t for i, t in enumerate(types) if i not in drop]
            seqs = [t for i, t in enumerate(seqs) if i not in drop]
            excess -= len(drop)
        if excess <= 0:
            break
    return ids, types


def truncate_encoding(ids: list[int], special_mask: list[int], limit: int, direction: Direction) -> list[int]:
    """Cut content tokens, never the special tokens the post-processor put at either end."""
    if len(ids) <= limit:
        return ids
    lead = 0
    while lead < len(ids) and special_mask[lead]:
        lead += 1
    trail = 0
    while trail < len(ids) - lead and special_mask[len(ids) - 1 - trail]:
        trail += 1
    keep = max(limit - lead - trail, 0)
    body = ids[lead:len(ids) - trail]
    body = body[:keep] if direction == "right" else body[len(body) - keep:]
    return ids[:lead] + body + ids[len(ids) - trail:]


def truncate_ids(ids: list[int], limit: int, direction: Direction) -> list[int]:
    if len(ids) <= limit:
        return ids
    return ids[:limit] if direction == "right" else ids[len(ids) - limit:]


@dataclass(slots=True)
class _Pending:
    """One `encode` call waiting for a tokenizer thread: its texts, how to cut them, where its answer goes."""

    texts: list[str]
    chars: int
    limit: int
    truncate: bool
    direction: Direction
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class TokenizerPool:
    def __init__(self, tokenizer_file: Path, workers: int) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self._pool = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="tokenizer",
                                        initializer=name_os_thread, initargs=("tokenizer",))
        self._workers = max(workers, 1)
        self._pending: deque[_Pending] = deque()  # encode calls not yet taken by a thread (see encode)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # calls no thread will take now: their callers are cancelled, as the pool's would be
            left, self._pending = list(self._pending), deque()
        for call in left:
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(call.future.cancel)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _encodings(self, texts: list[str]) -> list[Encoding]:
        if len(texts) == 1:
            return [self.tokenizer.encode(texts[0])]
        return self.tokenizer.encode_batch_fast(texts)

    def _encode_sync(self, texts: list[str], limit: int, truncate: bool, direction: Direction) -> list[Tokenized]:
        return self._cut(self._encodings(texts), limit, truncate, direction)

    @staticmethod
    def _cut(encodings: list[Encoding], limit: int, truncate: bool, direction: Direction) -> list[Tokenized]:
        """The engine inputs of one call's encodings: refused (InputTooLong) or cut to `limit`."""
        out = []
        for i, enc in enumerate(encodings):
            ids = enc.ids  # a new list on every read: read once
            length = len(ids)
            if length > limit:
                if not truncate:
                    raise InputTooLong(i, length, limit)
                ids = truncate_encoding(ids, enc.special_tokens_mask, limit, direction)
            out.append(Tokenized(ids, length))
        return out

    def _encode_pairs_sync(self, pairs: list[tuple[str, str]], limit: int, truncate: bool,
                           direction: Direction) -> list[Tokenized]:
        out = []
        for i, enc in enumerate(self.tokenizer.encode_batch_fast(pairs)):
            if len(enc.ids) > limit:
                if not truncate:
                    raise InputTooLong(i, len(enc.ids), limit)
                ids, types = truncate_pair(enc, limit, direction)
            else:
                ids, types = enc.ids, enc.type_ids
            out.append(Tokenized(ids, len(enc.ids), types if any(types) else None))
        return out

    async def encode_pairs(self, pairs: list[tuple[str, str]], limit: int, truncate: bool = True,
                           direction: Direction = "right") -> list[Tokenized]:
        return await self._run(self._encode_pairs_sync, pairs, limit, truncate, direction)

    async def encode(self, texts: list[str], limit: int, truncate: bool = True,
                     direction: Direction = "right", merge: bool = False) -> list[Tokenized]:
        """Tokenize on the pool; one short text is tokenized inline instead: ~100 us of work, where the
        two thread hops cost as much again and lengthen the single-query tail (bench/fastpath.py).

        With `merge` (bulk work: ModelService.tokenize passes it for requests that are not urgent), calls that
        wait for a thread together are tokenized together: a thread that comes free takes the calls queued by
        then (its share of them, up to MERGE_TEXTS texts and MERGE_CHARS characters; a larger call alone),
        encodes their texts in one batch and answers them all in one callback on the event loop. Under load
        the loop then wakes once for several requests instead of once each, which on a busy host cost it more
        than the request's own work. Each call keeps its own limit, truncation and errors (a batch the
        tokenizer fails is tokenized again call by call). Urgent calls are never merged: they do not wait for
        another request's texts."""
        if len(texts) == 1 and len(texts[0]) <= INLINE_CHARS:
            return self._encode_sync(texts, limit, truncate, direction)
        if not merge:
            return await self._run(self._encode_sync, texts, limit, truncate, direction)
        loop = asyncio.get_running_loop()
        call = _Pending(texts, sum(map(len, texts)), limit, truncate, direction, loop.create_future(), loop)
        with self._lock:
            self._pending.append(call)
        try:
            self._pool.submit(self._drain)  # one turn per call: a turn that finds the queue empty ends at once
        except RuntimeError:  # shut down (close): as run_in_executor would, and nothing left queued
            with self._lock, contextlib.suppress(ValueError):
                self._pending.remove(call)
            raise
        return await call.future

    def _take(self) -> list[_Pending]:
        """The calls one turn tokenizes together: the oldest queued, then more while they fit, at most this
        thread's share of the queue (the other threads take the rest in parallel)."""
        taken: list[_Pending] = []
        texts = chars = 0
        with self._lock:
            share = -(-len(self._pending) // self._workers)
            while self._pending and len(taken) < share:
                call = self._pending[0]
                if call.future.done():  # its caller left (cancelled): nothing to tokenize for it
                    self._pending.popleft()
                    continue
                if taken and (texts + len(call.texts) > MERGE_TEXTS or chars + call.chars > MERGE_CHARS):
                    break
                self._pending.popleft()
                taken.append(call)
                texts, chars = texts + len(call.texts), chars + call.chars
                if chars > MERGE_CHARS:  # a large call goes alone
                    break
        return taken

    def _drain(self) -> None:
        """On a tokenizer thread: take the calls queued now, tokenize their texts in one batch, answer them."""
        taken = self._take()
        if not taken:
            return
        answers: list[tuple[asyncio.Future, list[Tokenized] | None, BaseException | None]] = []
        try:
            encodings: list[Encoding] | None = None
            try:
                texts = taken[0].texts if len(taken) == 1 else [text for call in taken for text in call.texts]
                encodings = self._encodings(texts)
            except BaseException as exc:  # one call's text the tokenizer cannot take must not fail the others
                if len(taken) == 1:
                    answers.append((taken[0].future, None, exc))
            start = 0
            for at, call in enumerate(taken):
                end = start + len(call.texts)
                if at >= len(answers):
                    try:
                        mine = self._encodings(call.texts) if encodings is None else encodings[start:end]
                        answers.append((call.future, self._cut(mine, call.limit, call.truncate, call.direction),
                                        None))
                    except BaseException as exc:  # InputTooLong, or anything else: this call's alone
                        answers.append((call.future, None, exc))
                start = end
        finally:  # every call taken is answered, whatever happened above
            for call in taken[len(answers):]:
                answers.append((call.future, None, RuntimeError("tokenization failed")))
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for call, answer in zip(taken, answers, strict=True):
                by_loop.setdefault(call.loop, []).append(answer)
            for loop, some in by_loop.items():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
                    loop.call_soon_threadsafe(_answer, some)

    @staticmethod
    def from_ids(token_lists: list[list[int]], limit: int, truncate: bool, direction: Direction) -> list[Tokenized]:
        """Pre-tokenized input (OpenAI allows token arrays): only truncation applies."""
        out = []
        for i, ids in enumerate(token_lists):
            if len(ids) > limit and not truncate:
                raise InputTooLong(i, len(ids), limit)
            out.append(Tokenized(truncate_ids(ids, limit, direction), len(ids)))
        return out

    def _details_sync(self, texts: list[str], add_special_tokens: bool, max_tokens: int | None) -> list[list[dict]]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        total = sum(len(enc.ids) for enc in encodings)
        if max_tokens is not None and total > max_tokens:  # refused before the large part is built
            raise TooManyTokens(total, max_tokens)
        return [
            [
                {"id": tid, "text": tok, "special": bool(sp), "start": None if sp else s, "stop": None if sp else e}
                for tid, tok, sp, (s, e) in zip(enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets,
                                               strict=True)
            ]
            for enc in encodings
        ]

    async def details(self, texts: list[str], add_special_tokens: bool = True,
                      max_tokens: int | None = None) -> list[list[dict]]:
        """Every token with its id, text and offsets; TooManyTokens when they are over `max_tokens` in all."""
        return await self._run(self._details_sync, texts, add_special_tokens, max_tokens)

    def _decode_sync(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return self.tokenizer.decode_batch(ids, skip_special_tokens=skip_special_tokens)

    async def decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return await self._run(self._decode_sync, ids, skip_special_tokens)
