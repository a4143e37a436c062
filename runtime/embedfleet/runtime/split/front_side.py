"""A front process's models: each with its own tokenizer and spec, running its work on the engine process.

`FrontModels` and `FrontService` stand where `Models` and `ModelService` stand in a single process, so the
gate and the routes run unchanged: a route tokenizes here and calls `run`, which sends the token ids over the
link (link.py) and awaits the vectors. `batcher` is the engine's load as last pushed (`RemoteLoad`): enough
for the gate's early refusal and for /ready and /load; the engine takes the decisions themselves.

With several engines (`--engines N`) a front holds a link to each and sends each request to one of them
(spread.py); `batcher` is then the pod's load built from every engine's (`FrontService.update`).

While no link is up (the engine died or is restarting) every model counts as not loaded: new requests get
503 with Retry-After, /ready turns false. Requests that were waiting on an engine that died get 503
(EngineUnavailable) at once instead of hanging, whatever the other engines do.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from embedfleet.runtime.core.jobs import DeadlineUnmet, EngineUnavailable, QueueFull
from embedfleet.runtime.core.multivector import Marked
from embedfleet.runtime.core.quantize import Calibration, calibration_file
from embedfleet.runtime.core.tokenize import Tokenized, TokenizerPool
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.service import WATCH_AFTER_S, ClientGone, Models, ModelService, RunResult
from embedfleet.runtime.split import link
from embedfleet.runtime.split.spread import Candidate, pick_engine
from embedfleet.runtime.tenants import RequestOverQuota, Tenant
from embedfleet.runtime.timing import current_timing
from embedfleet.runtime.tracing import current_trace

log = logging.getLogger(__name__)
RECONNECT_S = 0.1


@dataclass(frozen=True)
class RemoteLoad:
    """One model's load in the engine, as of its last STATE frame (what `BatchManager` tells the gate)."""
    urgent_wait: float
    bulk_wait: float
    saturated: bool
    queued_tokens: int
    tokens_per_s: float

    def expected_wait(self, urgent: bool = False) -> float:
        return self.urgent_wait if urgent else self.bulk_wait


def _refusal(payload: dict) -> Exception:
    """The exception the engine raised, rebuilt here so that api/http.py maps it to the same answer."""
    kind, message = payload.get("kind"), str(payload.get("message", ""))
    if kind == "queue_full":
        return QueueFull(message, float(payload.get("retry_after") or 1), str(payload.get("reason") or "queue_tokens"))
    if kind == "deadline":
        return DeadlineUnmet(message)
    if kind == "over_quota":
        exc = RequestOverQuota.__new__(RequestOverQuota)
        ValueError.__init__(exc, message)
        return exc
    if kind == "oom":
        return MemoryError(message)
    if kind == "unavailable":
        return EngineUnavailable(message)
    if kind == "too_large":
        return link.TooLarge(message)
    return RuntimeError(f"engine: {message}")


class EngineLink:
    """The front's connection to the engine: requests multiplexed by id, STATE frames handed to `on_state`.
    Reconnects by itself; while down, `up` is False and every waiting request fails with EngineUnavailable."""

    def __init__(self, path: str, on_state: Callable[[dict | None], None]) -> None:
        self.path = path
        self.on_state = on_state
        self.up = False
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._writer is not None:
            self._writer.close()

    async def _run(self) -> None:
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path, limit=2**20)
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            self.up = True
            try:
                await self._read(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                log.warning("the engine process closed the link; answering 503 until it is back")
            except link.WireError as exc:
                log.error("the engine broke the link's format (%s); reconnecting", exc)
            except Exception:  # never leave the front without a link: reconnect whatever went wrong
                log.exception("reading the engine's link failed; reconnecting")
            finally:
                self.up = False
                self._writer.close()
                self._writer = None
                self.on_state(None)
                waiting, self._waiting = self._waiting, {}
                for future in waiting.values():
                    if not future.done():
                        future.set_exception(EngineUnavailable("the engine process stopped; retry shortly"))
            await asyncio.sleep(RECONNECT_S)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            kind, body = await link.read_frame(reader, link.MAX_REPLY_FRAME)
            if kind == link.STATE:
                self.on_state(link.read_json(body))
                continue
            if kind in (link.RESULT, link.RAGGED):
                request_id, *value = link.read_result(kind, body)
                outcome: object = tuple(value)
            elif kind == link.ERROR:
                request_id = link.ID.unpack_from(body)[0]
                outcome = _refusal(link.read_json(body, link.ID.size))
            elif kind == link.ANSWER:
                request_id, payload, data = link.read_answer(body)
                outcome = (payload, data)
            else:
                raise link.WireError(f"the engine sent a frame of kind {kind}")
            future = self._waiting.pop(request_id, None)
            if future is None or future.done():
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def send(self, make: Callable[[int], bytes]) -> tuple[int, asyncio.Future]:
        """Send the frame `make(id)` and return (id, the future of its answer)."""
        if self._writer is None or self._writer.is_closing():
            raise EngineUnavailable("the engine process is not running; retry shortly")
        request_id = next(self._ids)
        data = make(request_id)  # before the future is registered: a frame that cannot be built leaves nothing
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        self._writer.write(data)
        return request_id, future

    def cancel(self, request_id: int) -> None:
        self._waiting.pop(request_id, None)
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(link.frame(link.CANCEL, link.ID.pack(request_id)))


class FrontService(ModelService):
    """A model as a front serves it: spec and tokenizer here, the engines' work over the links."""

    links: list[EngineLink]  # set by FrontModels, one per engine process
    states: list[dict | None]  # this model's part of each engine's last STATE (None: down or not loaded)
    unanswered: list[int]  # per engine, the tokens this front sent and has not had answered
    state: dict | None = None  # the first live engine's state: the model card's figures, the same on every one

    def attach(self, links: list[EngineLink]) -> None:
        self.links = links
        self.states = [None] * len(links)
        self.unanswered = [0] * len(links)

    async def load(self) -> None:
        self.spec = await asyncio.to_thread(load_spec, self.entry.path, self.entry.name, self.entry.task)
        self.tokenizer = TokenizerPool(self.spec.path / "tokenizer.json",
                                       self.settings.tokenizer_workers or self.settings.cores())
        if self.spec.task == "embed":
            self.calibration = calibration_file(self.spec.path, self.spec.hidden_size)

    def update(self, state: dict | None, engine: int = 0) -> None:
        """Engine `engine`'s new STATE for this model (None: its link is down or the model is not loaded
        there)."""
        self.states[engine] = state
        live = [st for i, st in enumerate(self.states) if st is not None and self.links[i].up]
        if not live:
            self.state, self.batcher = None, None
            return
        self.state = live[0]  # the model card's figures (dtype, fingerprint, ...): the same on every engine
        # the pod's load as the gate reads it: a new request goes to the engine it would wait least on, so the
        # least waits; full only when every engine is; the queues and drain rates add up
        self.batcher = RemoteLoad(min(st["urgent_wait"] for st in live), min(st["bulk_wait"] for st in live),
                                  all(st["saturated"] for st in live), sum(st["queued_tokens"] for st in live),
                                  sum(st["tokens_per_s"] for st in live))
        limits = {k: min(st[k] for st in live) for k in ("max_batch_tokens", "max_batch_requests")}
        if any(getattr(self.settings, k) != v for k, v in limits.items()):
            self.settings = self.settings.model_copy(update=limits)

    def _candidates(self, urgent: bool) -> list[Candidate]:
        """The engines that can take this model's work now, as spread.pick_engine weighs them."""
        return [Candidate(i, st["urgent_wait"] if urgent else st["bulk_wait"], st["tokens_per_s"],
                          self.unanswered[i], st["saturated"])
                for i, st in enumerate(self.states) if st is not None and self.links[i].up]

    def _engine_for(self, tokens: int, urgent: bool, tenant: Tenant | None) -> int:
        quota = tenant is not None and tenant.tokens_per_minute is not None
        index = pick_engine(self._candidates(urgent), tokens, quota)
        if index is None:
            raise EngineUnavailable("the engine process is not running (the server is restarting it); "
                                    "retry shortly")
        return index

    @property
    def not_loaded_message(self) -> str:
        if any(lk.up for lk in self.links):
            return super().not_loaded_message
        return "the engine process is not running (the server is restarting it); retry shortly"

    @property
    def effective_dtype(self) -> str:
        return self.state["effective_dtype"] if self.state else self.settings.dtype

    @property
    def vector_space(self) -> str | None:
        return self.state["vector_space"] if self.state else None

    @property
    def fingerprint(self) -> str | None:
        return self.state["fingerprint"] if self.state else None

    @property
    def probe_status(self) -> str:
        return self.state["probe"] if self.state else "pending"

    async def calibrated(self) -> Calibration:
        """The engine's int8/uint8 calibration (it embeds the texts once, for every front)."""
        if self.calibration is None:
            async with self._calibrating:
                if self.calibration is None:
                    question = {"op": "calibration", "model": self.name}
                    engine = self.links[self._engine_for(0, True, None)]
                    _, future = engine.send(lambda i: link.frame(link.CALL, link.ID.pack(i),
                                                                 link.orjson.dumps(question)))
                    payload, data = await future  # EngineUnavailable: 503 (api/errors.py)
                    if "error" in payload:
                        raise RuntimeError(f"engine: {payload['error']}")
                    rows = np.frombuffer(data, dtype=np.float32).reshape(payload["shape"]).copy()
                    self.calibration = Calibration(rows, payload["source"])
        return self.calibration

    async def run(self, tokenized: list[Tokenized], disconnected: Callable[[], Awaitable[None]] | None = None,
                  urgent: bool | None = None, bounded: bool = False, deadline: float | None = None,
                  tenant: Tenant | None = None, arrived: float | None = None) -> RunResult:
        """An engine runs `ModelService.run` with these arguments (quota, admission, deadline, batching);
        a client that leaves while the work is expected to take a while is told to the engine (CANCEL)."""
        ids = [t.ids for t in tokenized]
        tokens = sum(map(len, ids))
        link.check_size(len(ids), tokens)  # RequestTooLarge: 413 (api/errors.py)
        pairs = bool(tokenized) and all(t.type_ids is not None for t in tokenized)
        marked = bool(tokenized) and isinstance(tokenized[0], Marked)  # ColBERT inputs (core/multivector.py)
        meta = {"model": self.name, "urgent": urgent, "bounded": bounded, "deadline": deadline, "arrived": arrived,
                "tenant": tenant.name if tenant is not None else None, "pairs": pairs, "marked": marked}
        trace = current_trace()
        if trace is not None:  # the engine's spans (queue wait, engine batch) continue this request's trace
            trace.span.set_attributes({"embedfleet.inputs": len(ids), "embedfleet.tokens": tokens})
            meta["trace"] = trace.carrier()
        types = [t.type_ids for t in tokenized] if pairs else None
        if marked:  # a Marked input says only whether it was truncated: one token more says it was
            lengths = [len(t) + int(t.truncated) for t in tokenized]
            attended = [-1 if t.attended is None else t.attended for t in tokenized]
        else:
            lengths, attended = [t.original_length for t in tokenized], None
        as_urgent = self.is_urgent(len(ids)) if urgent is None else urgent
        as_urgent = as_urgent and (tenant is None or tenant.interactive)  # the engine runs a batch tenant's as bulk
        engine = self._engine_for(tokens, as_urgent, tenant)
        engine_link, state = self.links[engine], self.states[engine]
        request_id, future = engine_link.send(lambda i: link.submit(i, meta, ids, types, lengths, attended))
        # the engine's figures from before this request: add its own tokens, as it will
        wait = 0.0 if state is None else ((state["urgent_wait"] if as_urgent else state["bulk_wait"])
                                          + tokens / max(state["tokens_per_s"], 1.0))
        self.unanswered[engine] += tokens
        try:
            if disconnected is not None and (deadline is not None or wait >= WATCH_AFTER_S):
                watcher = asyncio.ensure_future(disconnected())
                try:
                    done, _ = await asyncio.wait({future, watcher}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watcher.cancel()
                if future not in done:
                    raise ClientGone()
            rows, queue_s, inference_s = await future
        except BaseException:  # the client left, or this task was cancelled: the engine drops what is queued
            if not future.done():
                engine_link.cancel(request_id)
            raise
        finally:
            self.unanswered[engine] -= tokens
        timing = current_timing()
        if timing is not None:
            timing.ran(queue_s, inference_s)
        return RunResult(rows, sum(len(t) for t in tokenized))

    async def close(self) -> None:
        self.engine_thread.shutdown(wait=False)
        if self.tokenizer:
            self.tokenizer.close()


class FrontModels(Models):
    """The models of a front process: loaded once the link is up and the engine has loaded them."""

    service_class = FrontService

    def __init__(self, settings, metrics, link_paths: list[str]) -> None:
        super().__init__(settings, metrics)
        self.links = [EngineLink(path, partial(self._on_state, index)) for index, path in enumerate(link_paths)]
        for service in self.services.values():
            service.attach(self.links)  # type: ignore[attr-defined]

    _loaded_event: asyncio.Event | None = None  # set when the engine first says it has loaded (load waits)

    _engine_startup: dict | None = None  # the (first) engine process's cold start (its STATE), for /load

    def startup_report(self) -> dict:
        """The engine's cold start (weights, engine load, warm-up, ready: what the operator's cold-start
        Event reads from /load), with this front's first answer; the front's own until the engine has said."""
        own = super().startup_report()
        if not self._engine_startup:
            return own
        report = dict(self._engine_startup)
        phases = dict(report.get("phases") or {})
        if "first_request" in own["phases"]:
            phases.setdefault("first_request", own["phases"]["first_request"])
        report["phases"] = phases
        return report

    def _on_state(self, engine: int, state: dict | None) -> None:
        if state is not None and state.get("startup") and (engine == 0 or self._engine_startup is None):
            self._engine_startup = state["startup"]
        models = (state or {}).get("models", {})
        for name, service in self.services.items():
            service.update(models.get(name), engine)  # type: ignore[attr-defined]
        if state is not None and state.get("load_error"):
            self.load_error = f"engine: {state['load_error']}"
        if self._loaded_event is not None and state is not None and state.get("loaded"):
            self._loaded_event.set()

    async def load(self) -> None:
        self._loaded_event = asyncio.Event()
        for service in self.services.values():
            await service.load()
        for engine_link in self.links:
            engine_link.start()
        await self._loaded_event.wait()

    async def close(self) -> None:
        for engine_link in self.links:
            await engine_link.stop()
        for service in self.services.values():
            await service.close()
