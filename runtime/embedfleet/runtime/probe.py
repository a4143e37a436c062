"""Running the canonical probe set through a loaded model: the revision's fingerprint and vector space.

The model runs on its one engine thread, and the probe never beside that. The start-up probe runs directly
on the engine thread, in batches within the configured limits: once the model serves, so the first answer
does not wait for it (each of its small batches waits for the engine to have no request's work, so a
request arriving meanwhile waits for at most one of them, once per start); with --probe-reference, before the
model counts as loaded, so a reference that does not fit the model fails the start. Once serving, a re-run
(drift check, ?fresh=1) goes through the batch manager as bulk work, so its engine time and queue wait are
counted where admission and the autoscaler look, and it waits behind queries instead of delaying them unseen.

What a row is for each task, and how the fingerprint is taken: core/probe.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from embedfleet.compat import probe_set as canonical
from embedfleet.compat.gate import ProbeOutputs
from embedfleet.runtime.core import probe as rows
from embedfleet.runtime.core.batcher import BatchManager
from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.models.spec import Task

log = logging.getLogger(__name__)
AFTER_READY_S = 1.0  # the start-up probe begins this long after the model serves: the first requests go first
YIELD_ROWS = 4  # the start-up probe's batches once the model serves: small, so a request waits little
YIELD_S = 0.5  # the longest a start-up probe batch waits for the engine to have no request's work: under steady
#                traffic the probe (6 batches of the 24 texts) is done a few seconds after the start
IDLE_POLL_S = 0.005
PROBE_ATTEMPTS = 3  # runs of a start-up probe that fails before GET .../probe answers 503 for good
PROBE_TENANT = "embedfleet-probe"  # the batch manager's fairness and per-tenant wait histogram name it so
Rows = np.ndarray | list[np.ndarray]
Execute = Callable[[list], Awaitable[Rows]]  # engine inputs -> the engine's rows, in input order


@dataclass(frozen=True)
class ProbeState:
    """A revision's identity as this process measured it at start-up."""

    outputs: ProbeOutputs  # the start-up probe outputs (GET /v1/models/{model}/probe)
    fingerprint: str
    vector_space: str
    reference: ProbeOutputs  # what drift is measured against: --probe-reference, else `outputs`


class ProbeUnavailable(Exception):
    """The start-up probe failed: the model serves, its fingerprint is unknown (503 on GET .../probe)."""


class ProbePending(Exception):
    """The start-up probe is still running (503 with Retry-After on GET .../probe)."""


class StartupProbe:
    """One model's start-up probe once the model serves: its result (`state`), the task running it, and why
    it failed. The probe itself (`attempt`: run it and set `state`) is the model's (service.py)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.state: ProbeState | None = None  # fingerprint and vector space, once measured
        self.error: str | None = None  # why the last attempt failed
        self._task: asyncio.Task | None = None

    @property
    def started(self) -> bool:
        return self.state is not None or self._task is not None

    @property
    def status(self) -> str:
        """done, pending (not started yet, or running), or failed (every attempt, or stopped): GET /load's
        `probe`, which a client can poll without the errors a pending GET .../probe counts."""
        if self.state is not None:
            return "done"
        if self._task is None or not self._task.done():
            return "pending"
        return "failed"

    def start(self, attempt: Callable[[], Awaitable[None]], failed: Callable[[], None],
              done: Callable[[], None]) -> None:
        """AFTER_READY_S from now, `attempt` until it succeeds (PROBE_ATTEMPTS in all, backing off), so the
        first answers do not wait for it. `failed` is told of each failure (a drift check's `error`), `done`
        of the success. After the last failure GET .../probe answers 503 naming the failure's kind and the
        model goes on serving."""
        self._task = asyncio.get_running_loop().create_task(self._run(attempt, failed, done),
                                                            name=f"startup-probe-{self.model}")

    async def _run(self, attempt: Callable[[], Awaitable[None]], failed: Callable[[], None],
                   done: Callable[[], None]) -> None:
        await asyncio.sleep(AFTER_READY_S)
        for n in range(PROBE_ATTEMPTS):
            try:
                await attempt()
            except Exception as exc:
                self.error = type(exc).__name__
                failed()
                log.error("the start-up probe of %s failed (attempt %d of %d): %s: %s", self.model, n + 1,
                          PROBE_ATTEMPTS, type(exc).__name__, exc)
                if n + 1 < PROBE_ATTEMPTS:
                    await asyncio.sleep(2.0 ** n)
                continue
            self.error = None
            done()
            return

    async def wait(self, wait_s: float) -> ProbeState:
        """The state, waiting up to `wait_s` seconds for the probe while it runs. ProbePending when it is not
        done by then; ProbeUnavailable when it failed, or the server stopped it."""
        task = self._task
        if self.state is None and task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), wait_s)
            except TimeoutError:
                raise ProbePending(f"the start-up probe of {self.model} is still running; retry shortly") from None
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this caller was cancelled (its client left), not the probe
        if self.state is not None:
            return self.state
        why = self.error or ("stopped: the server is shutting down" if task is not None and task.cancelled()
                             else "not run")
        raise ProbeUnavailable(f"the start-up probe of {self.model} failed ({why}); the model serves, but its "
                               "fingerprint is unknown")

    async def close(self) -> None:
        """Stop a probe still running and wait until it is off the engine thread (before it shuts down)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def through_batcher(batcher: BatchManager) -> Execute:
    """Bulk work of the batch manager (a serving model)."""
    async def execute(inputs: list) -> Rows:
        return await batcher.submit(inputs, urgent=False, tenant=PROBE_TENANT).future
    return execute


def on_engine_thread(run: Callable[[list], Rows], engine_thread: Executor, max_requests: int,
                     max_tokens: int, idle: Callable[[], bool] | None = None) -> Execute:
    """Straight onto the engine thread in batches within --max-batch-requests and --max-batch-tokens. For a
    model already serving, `idle` (its batch manager's) says when the engine has no request's work: each
    batch waits for that, polled every IDLE_POLL_S, for at most YIELD_S (then it runs anyway, so steady
    traffic cannot starve it), and is at most YIELD_ROWS inputs, so a request arriving meanwhile waits
    for one small batch at most."""
    async def execute(inputs: list) -> Rows:
        size = max(1, min(max_requests, max_tokens // max(len(x) for x in inputs)))
        if idle is not None:
            size = min(size, YIELD_ROWS)
        loop = asyncio.get_running_loop()
        parts = []
        for i in range(0, len(inputs), size):
            if idle is not None:
                until = loop.time() + YIELD_S
                # a poll, once per start: simpler than an Event the batch manager would set on every batch
                while not idle() and loop.time() < until:  # noqa: ASYNC110
                    await asyncio.sleep(IDLE_POLL_S)
            parts.append(await loop.run_in_executor(engine_thread, run, inputs[i:i + size]))
        if isinstance(parts[0], np.ndarray):
            return np.vstack(parts)
        return [row for part in parts for row in part]
    return execute


async def run_probe(task: Task, tokenizer: TokenizerPool, execute: Execute, limit: int) -> ProbeOutputs:
    """The probe set's outputs for `task` (rows: core/probe.py), run by `execute`.

    Plain texts, truncated to `limit` tokens: a ColBERT model's texts go without query/document markers,
    since the probe measures the weights and arithmetic (markers are code, the same in both revisions).
    """
    probe = canonical.load()
    if task == "rerank":
        pairs = probe.pairs()
        tokenized = await tokenizer.encode_pairs(pairs, limit, True, "right")
    else:
        tokenized = await tokenizer.encode(list(probe.texts), limit, True, "right")
    raw = await execute(tokenized)
    if task == "embed":
        out = rows.embed_rows(raw)
    elif task == "sparse":
        out = rows.sparse_rows(raw)
    elif task == "multivector":
        out = rows.multivector_rows(raw)
    elif task == "rerank":
        out = rows.rerank_rows(raw, [len(r.documents) for r in probe.rerank])
    else:
        out = rows.classify_rows(raw)
    return ProbeOutputs.of(task, out, probe.version)


def vector_space_of(configured: str, revision: str, digest: str) -> str:
    """--vector-space if given, else the revision, else `weights-` + 12 hex of the model files' digest."""
    return configured or revision or rows.weights_space(digest)


def startup_state(outputs: ProbeOutputs, configured_space: str, revision: str,
                  reference: ProbeOutputs | None, digest: str) -> ProbeState:
    """The start-up identity; a reference that cannot be compared with these outputs (another task or
    shape: another kind of model) is a configuration error, raised naming --probe-reference."""
    fp = rows.fingerprint(outputs.probe_set, outputs.task, outputs.outputs)
    if reference is not None:
        if reference.task != outputs.task:
            raise ValueError(f"--probe-reference holds {reference.task} outputs, but this model's task is "
                             f"{outputs.task}: take the reference from a model of the same task")
        if reference.outputs.shape != outputs.outputs.shape:
            raise ValueError(f"--probe-reference outputs are {reference.outputs.shape[0]} x "
                             f"{reference.outputs.shape[1]}, this model's are {outputs.outputs.shape[0]} x "
                             f"{outputs.outputs.shape[1]}: not the same kind of model")
    return ProbeState(outputs, fp, vector_space_of(configured_space, revision, digest),
                      reference if reference is not None else outputs)
