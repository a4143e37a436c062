"""The service of one model: tokenizer pool + batch manager + engine, and their state.

Routes call `tokenize*()` then `run()`; everything between the HTTP layer and the engine is here,
so a second front-end (the async Redis worker) reuses the same path. `Models` holds one service
per served model; each has its own queue and limits.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from embedfleet.compat.gate import ProbeOutputs
from embedfleet.compat.names import split_model, with_revision
from embedfleet.runtime import probe as probing
from embedfleet.runtime.cold_start import read_weights_source
from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.core.drain_rate import timed_seed
from embedfleet.runtime.core.engine_thread import EngineThread
from embedfleet.runtime.core.jobs import DeadlineUnmet, QueueFull
from embedfleet.runtime.core.quantize import CALIBRATION_TEXTS, Calibration, calibration_file
from embedfleet.runtime.core.tokenize import Direction, Tokenized, TokenizerPool
from embedfleet.runtime.drift import DriftMonitor
from embedfleet.runtime.engines.base import Engine
from embedfleet.runtime.engines.cache_dir import BuildSource
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.models.spec import ModelSpec, Task, load_spec
from embedfleet.runtime.settings import ModelEntry, RuntimeSettings
from embedfleet.runtime.tenants import DEFAULT_TENANT, RequestOverQuota, Tenant
from embedfleet.runtime.timing import current_timing
from embedfleet.runtime.tracing import current_trace

if TYPE_CHECKING:  # torch comes with it, and a front process (split/) never needs torch
    from embedfleet.runtime.engines import gpu_batching as sizing

log = logging.getLogger(__name__)
SEED_BATCH_CPU = (8, 32)  # rows x tokens of the batch timed at start-up to seed the drain rate (_timed_batch)
SEED_BATCH_GPU = (16, 128)
WATCH_AFTER_S = 0.05  # work expected to finish sooner is not watched for a client leaving (see ModelService._rows)


@dataclass
class RunResult:
    # pooled unnormalised vectors, logits or SPLADE weights; for multivector models a list of per-token
    # arrays; input order
    rows: np.ndarray | list[np.ndarray]
    tokens: int


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def engine_fn(engine: Engine, task: Task) -> Callable[[list], np.ndarray | list[np.ndarray]]:
    """The engine method that serves `task`: what the batch manager runs. Only the one asked for is
    looked up: an engine without sparse or per-token outputs (trtllm) is refused those tasks earlier."""
    if task == "embed":
        return engine.embed
    if task == "sparse":
        return engine.embed_sparse
    if task == "multivector":
        return engine.embed_tokens
    return engine.classify


def engine_build_source(engine: Engine) -> BuildSource | None:
    """Where the build an engine loads came from: set by the engines that build something from the weights
    (int8, trtllm; engines/cache_dir.py), absent on the others."""
    found = getattr(engine, "build_source", None)
    return found if isinstance(found, BuildSource) else None


def build_engine(settings: RuntimeSettings, spec: ModelSpec) -> Engine:
    if settings.engine == "trtllm" and spec.task in ("sparse", "multivector"):
        raise ValueError(f"the trtllm engine does not serve {spec.task} models; use --engine torch")
    if settings.dtype == "int8":
        if settings.engine != "torch":
            raise ValueError("--dtype int8 runs on the CPU engine (engines/int8_cpu.py); use --engine torch")
        from embedfleet.runtime.engines.int8_cpu import Int8Rejected, build_int8_engine, refusal
        from embedfleet.runtime.engines.int8_scoring import build_int8_scoring_engine

        why = refusal(spec, settings.device)
        if why:
            raise Int8Rejected(why)
        def float32() -> Engine:  # what serves where int8 is refused and --no-int8-strict allows it
            return torch_engine(settings, spec, "float32")

        if spec.task != "embed":  # rerankers and classifiers: judged on scores and labels, not cosines
            return build_int8_scoring_engine(spec, num_threads=settings.num_threads or settings.cores(),
                                             strict=settings.int8_strict, cache_root=settings.engine_cache_dir,
                                             fallback=float32)
        return build_int8_engine(spec, num_threads=settings.num_threads or settings.cores(),
                                 min_cosine=settings.int8_min_cosine, strict=settings.int8_strict,
                                 cache_root=settings.engine_cache_dir, fallback=float32)
    if settings.engine == "trtllm":
        from embedfleet.runtime.engines.trtllm_engine import TrtLlmEngine

        return TrtLlmEngine(spec, settings)
    return torch_engine(settings, spec, settings.dtype)


def torch_engine(settings: RuntimeSettings, spec: ModelSpec, dtype: str) -> Engine:
    """The torch engine as the settings ask for it, in `dtype` (the settings' own, or float32 where int8 was
    refused): the float32 that serves a refused int8 honours --no-packed, --model-impl and the batching flags
    like any other."""
    from embedfleet.runtime.engines.torch_engine import TorchEngine

    # on CUDA a budget the user did not set is chosen from free memory after loading (engines/gpu_batching.py)
    sized = settings.device != "cuda" or "max_batch_tokens" in settings.model_fields_set
    return TorchEngine(spec, device=settings.device, dtype=dtype,
                       num_threads=settings.num_threads or settings.cores(),
                       max_batch_tokens=settings.max_batch_tokens if sized else None,
                       fp8_min_cosine=settings.fp8_min_cosine,
                       fp8_strict=settings.fp8_strict, fp8_activation_scaling=settings.fp8_activation_scaling,
                       cuda_graphs=settings.cuda_graphs, max_batch_requests=settings.max_batch_requests,
                       packed=settings.packed, compile=settings.compile, native=settings.model_impl == "auto")


def gpu_batching(settings: RuntimeSettings, engine: Engine, run: Callable[[list], object]) -> sizing.Batching | None:
    """On the engine thread, for a torch engine on CUDA: the batching sized for the GPU (the values the
    user did not set), with the per-call overhead measured here. None elsewhere (the settings serve)."""
    from embedfleet.runtime.engines import gpu_batching as sizing

    model = getattr(engine, "model", None)
    if settings.device != "cuda" or model is None or not hasattr(engine, "free_memory"):
        return None
    fields = ("max_batch_tokens", "max_batch_requests", "batch_overhead_tokens")
    user = {f: getattr(settings, f) for f in fields if f in settings.model_fields_set}
    spec = engine.spec  # type: ignore[attr-defined]
    # several engines on one GPU (--engines): each sizes its batches from its share of the free memory
    free = engine.free_memory() // max(1, settings.engines)
    chosen = sizing.choose(user, model.config, engine.effective_dtype, free, spec.max_length)
    if "batch_overhead_tokens" in user:
        return chosen
    token = spec.pad_token_id + 1
    width = min(256, spec.max_length)
    rows = max(1, min(chosen.max_batch_requests, chosen.max_batch_tokens // width))
    small, large = [[token] * 8], [[token] * width for _ in range(rows)]
    times = []
    for batch in (small, large):
        run(batch)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            run(batch)
            best = min(best, time.perf_counter() - started)
        times.append(best)
    return replace(chosen, batch_overhead_tokens=sizing.overhead_tokens(times[0], times[1], rows * width, 8))


class ModelService:
    def __init__(self, entry: ModelEntry, settings: RuntimeSettings, metrics: RuntimeMetrics) -> None:
        self.entry = entry
        self.name = entry.name
        self.settings = settings
        self.metrics = metrics.for_model(entry.name)
        self._runtime_metrics = metrics
        self.spec: ModelSpec | None = None
        self.engine: Engine | None = None
        self.tokenizer: TokenizerPool | None = None
        self.batcher: BatchManager | None = None
        self.engine_thread = EngineThread(f"engine-{entry.name}")
        self.vector_cache = None  # an asyncq.cache.VectorCache when --cache-enabled (embedding models only)
        self.calibration: Calibration | None = None  # int8/uint8 ranges (core/quantize.py): see calibrated()
        self._calibrating = asyncio.Lock()
        self.created = int(time.time())
        self.startup = probing.StartupProbe(entry.name)  # run once the model serves (or before, with a reference)
        self._vector_space: str | None = None
        self.drift: DriftMonitor | None = None
        self.batching: sizing.Batching | None = None  # on CUDA: the batching sized for the GPU

    @property
    def loaded(self) -> bool:
        return self.batcher is not None

    @property
    def not_loaded_message(self) -> str:
        """What a request for this model is told (503) while it is not loaded."""
        return "the model is still loading; retry shortly"

    @property
    def task(self) -> Task:
        assert self.spec is not None
        return self.spec.task

    @property
    def effective_dtype(self) -> str:
        """The precision actually served: `fp8` may have fallen back to bfloat16 at the quality gate."""
        return self.engine.effective_dtype if self.engine is not None else self.settings.dtype

    @property
    def fp8_min_cosine(self) -> float | None:
        gate = self.engine.fp8_gate if self.engine is not None else None
        return gate.min_cosine if gate is not None else None

    @property
    def int8_min_cosine(self) -> float | None:
        """The int8 gate's lowest cosine as this process measured it (served or refused): on the judged set of a
        build it made, on the probe of a cached one. None when int8 was not asked for, or when a cached build's
        stored refusal was taken as it is (its file's figures are forgeable and measured by no one here)."""
        gate = self.engine.int8_gate if self.engine is not None else None
        return gate.min_cosine if gate is not None and gate.measured_on in ("judge", "probe") else None

    @property
    def input_limit(self) -> int:
        assert self.spec is not None
        limit = self.spec.max_length
        if self.settings.max_input_tokens:
            limit = min(limit, self.settings.max_input_tokens)
        return min(limit, self.settings.max_batch_tokens)

    async def load(self) -> None:
        cold = self._runtime_metrics.cold_start
        cold.weights(self.name, await asyncio.to_thread(read_weights_source, self.entry.path))
        started = time.perf_counter()
        spec = await asyncio.to_thread(load_spec, self.entry.path, self.entry.name, self.entry.task)
        # Load, warm up and run the model on one thread for the process' life: torch's OpenMP pools are
        # per calling thread, and a model touched from several threads ran single queries 2x slower here.
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(self.engine_thread, build_engine, self.settings, spec)
        built = time.perf_counter()
        cold.engine_loaded(self.name, built - started)
        found = engine_build_source(engine)
        if found is not None:
            cold.engine_build(self.name, found)
        await loop.run_in_executor(self.engine_thread, engine.warmup)
        self.spec, self.engine = spec, engine
        run = engine_fn(engine, spec.task)
        batching = await loop.run_in_executor(self.engine_thread, gpu_batching, self.settings, engine, run)
        if batching is not None:
            self.batching = batching
            self.settings = self.settings.model_copy(update={
                "max_batch_tokens": batching.max_batch_tokens, "max_batch_requests": batching.max_batch_requests,
                "batch_overhead_tokens": batching.batch_overhead_tokens})
            log.info("batching of %s on the GPU: %s", spec.name, batching.summary())
        gate = engine.fp8_gate
        if gate is not None:
            self._runtime_metrics.fp8_min_cosine.labels(self.name).set(gate.min_cosine)
            self._runtime_metrics.fp8_accepted.labels(self.name).set(1 if gate.passed else 0)
        self.tokenizer = TokenizerPool(spec.path / "tokenizer.json",
                                       self.settings.tokenizer_workers or self.settings.cores())
        if spec.task == "embed":
            self.calibration = calibration_file(spec.path, spec.hidden_size)  # a bad file fails the load here
        batcher = BatchManager(run, self.settings.max_batch_tokens, self.settings.max_batch_requests,
                               self.settings.max_queue_tokens, self.metrics, self.engine_thread,
                               self.settings.batch_overhead_tokens, self.settings.bulk_batch_seconds,
                               self.settings.shared_batch_seconds, self.settings.max_queue_seconds,
                               packed=getattr(engine, "runs_packed", False),
                               by_length=getattr(engine, "packs_by_length", False))
        if self.settings.preempt_bulk and getattr(engine, "preemptible", False):
            batcher.preemptible_in(engine.between_layers(batcher.preempt_point))  # type: ignore[attr-defined]
        tokens, seconds = await loop.run_in_executor(self.engine_thread, self._timed_batch, run)
        batcher.seed_rate(tokens, seconds)
        s = self.settings
        self._vector_space = probing.vector_space_of(s.vector_space, s.revision, spec.digest)
        reference = s.reference()
        # made now, before /ready, so its series are exported (at zero) from the start
        self.drift = DriftMonitor(self.name, reference, self.run_probe, s.probe_interval, s.probe_min_cosine,
                                  self._runtime_metrics)
        if reference is not None:  # a reference that does not fit this model fails the start, before /ready
            await self._fingerprint(probing.on_engine_thread(run, self.engine_thread, s.max_batch_requests,
                                                             s.max_batch_tokens), reference)
        batcher.start()
        self.batcher = batcher
        cold.warmed_up(self.name, time.perf_counter() - built)
        if self.probe is not None:
            self.drift.start()
        log.info("serving %s: %s %s (%s, pooling=%s, max_tokens=%d) on %s/%s", spec.name, spec.task,
                 spec.model_type, ",".join(spec.architectures), spec.pooling, self.input_limit,
                 self.settings.device, self.effective_dtype)

    async def _fingerprint(self, execute: probing.Execute, reference: ProbeOutputs | None) -> None:
        """The start-up probe through `execute`: fingerprint, the `embedfleet_model_info` series, and the
        drift monitor. With --probe-reference the start-up outputs are its first check, at no extra engine
        cost."""
        assert self.spec is not None and self.tokenizer is not None
        s = self.settings
        started = time.perf_counter()
        outputs = await probing.run_probe(self.spec.task, self.tokenizer, execute, self.input_limit)
        state = self.startup.state = probing.startup_state(outputs, s.vector_space, s.revision, reference,
                                                           self.spec.digest)
        self._runtime_metrics.model_info.labels(self.name, s.revision, state.vector_space, state.fingerprint).set(1)
        log.info("probe %s of %s in %.2fs: fingerprint %s, vector space %s%s", outputs.probe_set, self.name,
                 time.perf_counter() - started, state.fingerprint, state.vector_space,
                 f", revision {s.revision}" if s.revision else "")
        assert self.drift is not None
        self.drift.reference = state.reference
        if reference is not None:
            self.drift.record(outputs)

    @property
    def probe(self) -> probing.ProbeState | None:
        """Fingerprint and vector space, once the start-up probe measured them."""
        return self.startup.state

    @property
    def probe_status(self) -> str:
        return self.startup.status

    def start_probe(self) -> None:
        """Start the start-up probe (Models.load calls it once every model serves; a no-op when it ran before
        /ready, with --probe-reference). Its small batches go onto the engine thread when no request's work
        is there (probe.on_engine_thread; a request arriving meanwhile waits for at most one of them),
        uncounted as traffic."""
        if self.startup.started or self.batcher is None:
            return
        s, batcher = self.settings, self.batcher
        execute = probing.on_engine_thread(batcher.engine_fn, self.engine_thread, s.max_batch_requests,
                                           s.max_batch_tokens, idle=lambda: batcher.idle)
        failed = self._runtime_metrics.probe_checks.labels(self.name, "error").inc
        assert self.drift is not None
        self.startup.start(lambda: self._fingerprint(execute, None), failed, self.drift.start)

    async def startup_probe(self, wait_s: float) -> probing.ProbeState:
        """The start-up probe's state (probe.StartupProbe.wait)."""
        return await self.startup.wait(wait_s)

    async def run_probe(self) -> ProbeOutputs:
        """The probe set through this model's batch manager, now (drift checks, GET .../probe?fresh=1)."""
        assert self.spec is not None and self.tokenizer is not None and self.batcher is not None
        return await probing.run_probe(self.spec.task, self.tokenizer, probing.through_batcher(self.batcher),
                                       self.input_limit)

    @property
    def revision(self) -> str:
        return self.settings.revision

    @property
    def vector_space(self) -> str | None:
        """Known once the model is read (--vector-space, else --revision, else the weights' digest)."""
        return self._vector_space

    @property
    def fingerprint(self) -> str | None:
        return self.probe.fingerprint if self.probe is not None else None

    async def calibrated(self) -> Calibration:
        """The int8/uint8 calibration: the model directory's file (read at load), else the shipped texts
        embedded on first use, once. Lazily, because every start-up would otherwise pay for it (2.5 s for
        all-MiniLM on two busy CPU cores) though most deployments never ask for int8; the first request
        that does waits for it. The engine thread runs one call at a time, so it queues with traffic."""
        if self.calibration is None:
            async with self._calibrating:
                if self.calibration is None:
                    assert self.batcher is not None and self.task == "embed"
                    self.calibration = await self._calibrate(self.batcher.engine_fn)
        return self.calibration

    async def _calibrate(self, run) -> Calibration:
        """Embed the shipped calibration texts in batches within the token budget: the rows int8/uint8
        ranges are taken from (core/quantize.py)."""
        assert self.tokenizer is not None
        tokenized = await self.tokenizer.encode(list(CALIBRATION_TEXTS), self.input_limit, True, "right")
        longest = max(len(t) for t in tokenized)
        size = max(1, min(self.settings.max_batch_requests, self.settings.max_batch_tokens // longest))
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        rows = [await loop.run_in_executor(self.engine_thread, run, tokenized[i:i + size])
                for i in range(0, len(tokenized), size)]
        log.info("calibrated int8/uint8 ranges of %s on %d texts in %.2f s", self.name, len(tokenized),
                 time.perf_counter() - started)
        return Calibration(np.vstack(rows).astype(np.float32), f"builtin:{len(tokenized)} texts")

    def _timed_batch(self, run) -> tuple[int, float]:
        """Tokens and seconds of one small engine batch, to seed the drain rate that admission divides by,
        so the first requests are judged by a measurement instead of being admitted blind (`timed_seed`:
        the fastest of a few runs). On a CPU the batch is small (8 x 32 tokens: tens of milliseconds of a
        start on two cores; its rate is on the low side, since a small batch carries the per-batch overhead
        over fewer tokens); on a GPU, where that overhead would dominate, 16 x 128. Either is replaced
        within a few batches of real traffic."""
        assert self.spec is not None
        rows, width = SEED_BATCH_GPU if self.settings.device == "cuda" else SEED_BATCH_CPU
        length = max(2, min(width, self.input_limit))
        count = max(1, min(rows, self.settings.max_batch_requests, self.settings.max_batch_tokens // length))
        return timed_seed(run, [[self.spec.pad_token_id + 1] * length for _ in range(count)])

    async def close(self) -> None:
        await self.startup.close()  # off the engine thread before it shuts down
        if self.drift is not None:
            await self.drift.stop()
        if self.batcher:
            await self.batcher.stop()
        self.engine_thread.shutdown(wait=True)
        if self.tokenizer:
            self.tokenizer.close()

    async def tokenize(self, inputs: Sequence[str] | Sequence[list[int]], truncate: bool,
                       direction: Direction) -> list[Tokenized]:
        assert self.tokenizer is not None
        trace, timing = current_trace(), current_timing()
        if trace is not None:
            trace.tokenizing(self.name, pairs=False)
        started = time.perf_counter()
        if inputs and isinstance(inputs[0], str):
            out = await self.tokenizer.encode(list(inputs), self.input_limit, truncate, direction,
                                              merge=not self.is_urgent(len(inputs)))  # bulk work only
        else:
            out = TokenizerPool.from_ids(list(inputs), self.input_limit, truncate, direction)
        if timing is not None:
            timing.tokenized(time.perf_counter() - started)
        if trace is not None:
            trace.tokenized(out)
        return out

    async def tokenize_pairs(self, pairs: list[tuple[str, str]], truncate: bool,
                             direction: Direction) -> list[Tokenized]:
        assert self.tokenizer is not None
        trace, timing = current_trace(), current_timing()
        if trace is not None:
            trace.tokenizing(self.name, pairs=True)
        started = time.perf_counter()
        out = await self.tokenizer.encode_pairs(pairs, self.input_limit, truncate, direction)
        if timing is not None:
            timing.tokenized(time.perf_counter() - started)
        if trace is not None:
            trace.tokenized(out)
        return out

    def is_urgent(self, count: int, bulk: bool = False) -> bool:
        """Small requests are urgent (they jump ahead of bulk work, bounded by --max-queue-seconds);
        large ones, and any the client marks bulk, wait behind them (--max-queue-seconds-bulk)."""
        return not bulk and count <= self.settings.urgent_max_inputs

    async def run(self, tokenized: list[Tokenized], disconnected: Callable[[], Awaitable[None]] | None = None,
                  urgent: bool | None = None, bounded: bool = False, deadline: float | None = None,
                  tenant: Tenant | None = None, arrived: float | None = None) -> RunResult:
        """Through the tenant's quota and the batch manager; if the client goes first (`disconnected()`
        resolves), its queued inputs are dropped.

        `bounded`: refuse (QueueFull) when the expected wait, counted from `arrived`, passes
        --max-queue-seconds (urgent) or --max-queue-seconds-bulk; HTTP routes ask for it, the async
        worker does not (its job waits in Redis anyway). `deadline` (time.monotonic()): refuse at once
        if it cannot be met, and drop the work with DeadlineUnmet if it passes while queued. `tenant`:
        its quota is charged (QuotaExceeded, RequestOverQuota; given back if the work is refused), a
        batch tenant's work is never urgent, and the planner shares the engine fairly between tenants.
        """
        assert self.batcher is not None
        name = tenant.name if tenant is not None else DEFAULT_TENANT
        lengths = list(map(len, tokenized))  # once per input: the batch manager reuses them
        tokens = sum(lengths)
        truncated = sum(t.truncated for t in tokenized)
        if truncated:
            self.metrics.truncated.inc(truncated)
        if urgent is None:
            urgent = self.is_urgent(len(tokenized))
        if tenant is not None and not tenant.interactive:
            urgent = False
        max_wait = None
        if bounded:
            max_wait = self.settings.max_queue_seconds if urgent else self.settings.max_queue_seconds_bulk
        try:
            charged = tenant.charge(tokens) if tenant is not None else False
        except (QueueFull, RequestOverQuota):
            self._runtime_metrics.tenant_refused.labels(name, "quota").inc()
            raise
        submit = partial(self._rows, urgent=urgent, disconnected=disconnected, max_wait=max_wait, deadline=deadline,
                         tenant=name, arrived=arrived)
        try:
            if self.vector_cache is not None and self.task == "embed":  # it submits the inputs it does not hold
                rows = await self.vector_cache.through(self.spec.digest, tokenized, submit)
            else:
                rows = await submit(tokenized, lengths=lengths)
        except (QueueFull, DeadlineUnmet) as exc:
            if charged:
                tenant.give_back(tokens)
            reason = exc.reason if isinstance(exc, QueueFull) else "deadline"
            self._runtime_metrics.tenant_refused.labels(name, reason).inc()
            raise
        except BaseException:
            if charged:  # the engine failed, or the client left: nothing was delivered
                tenant.give_back(tokens)
            raise
        self.metrics.tenant_requests(name).inc()
        self.metrics.tenant_tokens(name).inc(tokens)
        return RunResult(rows, tokens)

    async def _rows(self, tokenized: list[Tokenized], urgent: bool,
                    disconnected: Callable[[], Awaitable[None]] | None, max_wait: float | None = None,
                    deadline: float | None = None, tenant: str = "", arrived: float | None = None,
                    lengths: list[int] | None = None) -> np.ndarray:
        """Submit and wait. A client leaving is watched (a task reading the connection) only for work
        expected to take WATCH_AFTER_S or more: dropping a query's few milliseconds of work saves
        nothing, and the watcher costs every query a task and a wait on two futures."""
        trace = current_trace()
        if trace is not None:
            trace.queued(len(tokenized), sum(map(len, tokenized)), urgent)
        job = self.batcher.submit(tokenized, urgent=urgent, max_wait=max_wait, deadline=deadline, tenant=tenant,
                                  arrived=arrived, trace=trace, lengths=lengths)
        timing = current_timing()
        if deadline is None and (disconnected is None or self.batcher.expected_wait(urgent) < WATCH_AFTER_S):
            rows = await job.future
            if timing is not None:
                timing.ran(job.queue_s, job.inference_s)
            return rows
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        waiting = {job.future} if watcher is None else {job.future, watcher}
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watcher is not None:
                watcher.cancel()
        if job.future in done:
            if timing is not None:
                timing.ran(job.queue_s, job.inference_s)
            return job.future.result()
        if watcher is not None and watcher in done:
            self.batcher.cancel(job)
            raise ClientGone()
        # The deadline passed first: whatever of the job is still queued never runs.
        self.batcher.expire(job)
        return job.future.result()  # raises DeadlineUnmet (or the result, had it just been set)


class Models:
    """Every served model by name, loaded in the background at start-up."""

    service_class: type[ModelService] = ModelService  # a front process's models run on the engine's (split/)

    def __init__(self, settings: RuntimeSettings, metrics: RuntimeMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        metrics.max_queue_seconds.set(settings.max_queue_seconds)  # the bound the saturation alert compares with
        self.services = {e.name: self.service_class(e, settings, metrics) for e in settings.models()}
        self.tenants = settings.tenants()
        unknown = {m for t in self.tenants.all.values() for m in t.models} - set(self.services) - {"*"}
        if unknown:  # one keys Secret may serve several deployments: a warning, not a refusal
            log.warning("the API keys file names models this server does not serve: %s", ", ".join(sorted(unknown)))
        self.load_error: str | None = None

    @property
    def loaded(self) -> bool:
        return all(s.loaded for s in self.services.values())

    def startup_report(self) -> dict:
        """The `startup` section of GET /load: this process's cold start by phase (cold_start.py)."""
        return self.metrics.cold_start.report()

    @property
    def saturated(self) -> bool:
        """A hard cap is reached (the gate refuses everything before reading the body)."""
        return any(s.batcher is not None and s.batcher.saturated for s in self.services.values())

    def refusing_all(self) -> int | None:
        """Retry-After seconds when every new request would be refused for its expected wait (urgent
        work past --max-queue-seconds and all work past --max-queue-seconds-bulk, on every model), so
        the gate can answer 429 before reading, parsing and tokenizing the body; else None."""
        waits = []
        for s in self.services.values():
            if s.batcher is None:
                return None
            urgent, bulk = s.batcher.expected_wait(urgent=True), s.batcher.expected_wait(urgent=False)
            if urgent <= self.settings.max_queue_seconds or bulk <= self.settings.max_queue_seconds_bulk:
                return None
            waits.append(min(urgent - self.settings.max_queue_seconds, bulk - self.settings.max_queue_seconds_bulk))
        return max(1, math.ceil(min(waits))) if waits else None

    @property
    def overloaded(self) -> bool:
        """A new small request would be refused for its expected wait: /ready turns false so that the
        load balancer sends work elsewhere."""
        bound = self.settings.max_queue_seconds
        return any(s.batcher is not None and s.batcher.expected_wait(urgent=True) > bound
                   for s in self.services.values())

    def expected_wait(self) -> float:
        """The longest expected queue wait over the models (seconds): what a gateway compares replicas by."""
        return max((s.batcher.expected_wait() for s in self.services.values() if s.batcher is not None),
                   default=0.0)

    def load_report(self) -> dict:
        """Per model: queued tokens, measured drain rate and expected wait (GET /load)."""
        return {name: {"queue_tokens": s.batcher.queued_tokens, "tokens_per_s": round(s.batcher.tokens_per_s, 1),
                       "expected_wait_s": round(s.batcher.expected_wait(), 4), "probe": s.probe_status}
                for name, s in self.services.items() if s.batcher is not None}

    async def load(self) -> None:
        for service in self.services.values():
            try:
                await service.load()
            except Exception as exc:
                self.load_error = f"{service.name}: {type(exc).__name__}: {exc}"
                log.error("model failed to load: %s", self.load_error)
                raise
        self.metrics.cold_start.all_ready()
        for service in self.services.values():  # once every model serves: no probe beside another's load
            service.start_probe()

    async def close(self) -> None:
        for service in self.services.values():
            await service.close()

    def names(self) -> list[str]:
        return list(self.services)

    def served_names(self) -> list[str]:
        """Every name a request may use: each model's, and with --revision also `<name>@<revision>`."""
        revision = self.settings.revision
        return [n for name in self.services for n in ((name, with_revision(name, revision)) if revision else (name,))]

    def vector_spaces(self) -> list[str]:
        """The vector spaces of the loaded models (one, unless several models each keep their own)."""
        return sorted({s.vector_space for s in self.services.values() if s.vector_space is not None})

    def pick(self, name: str | None, task: Task) -> ModelService | None:
        """The named model, or the first one serving `task` when the request names none. `<name>@rN`
        names this runtime's revision of the model; another revision's suffix is not served here (None)."""
        if name is not None:
            if name in self.services:
                return self.services[name]
            base, revision = split_model(name)
            if revision is None or revision != self.settings.revision:
                return None
            return self.services.get(base)
        return next((s for s in self.services.values() if s.spec is None or s.task == task),
                    next(iter(self.services.values())))
