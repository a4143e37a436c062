"""The batch manager: the event loop feeding one engine thread.

Requests enqueue their tokenized inputs and await a future; the scheduler plans a batch with
`plan_batch` whenever the engine is free, runs it on the engine thread, and scatters rows back in
each request's input order. Queued work whose client has gone, or whose deadline has passed, is dropped
before it reaches the engine.

Scheduling is driven by callbacks, not by a task awaiting the engine: a lone query on an idle server
is on the engine thread one loop turn after it is queued, the engine thread hands its rows straight to
a callback that completes the requests' futures, and whatever is bookkeeping (metrics, gauges, the
fairness ledger, the drain rate; the figures are kept in `core/bookkeeping.py`) runs while the engine
computes or after the answers are out. On two CPU cores each extra hop through asyncio's future chaining
cost tens of microseconds of a query's few milliseconds, on caches the forward pass had just evicted.

Admission (`core/admission.py`) needs the tokens queued ahead of a request and the engine's drain
rate on every submit, so both are running figures: totals kept as items enter and leave (a submit
costs the size of its own request, never a scan of the queue), and a rate measured over recent
batches (`core/drain_rate.py`: the most pessimistic of the long-run rate, the last seconds' and the
last batches', and the batch in the engine). A dropped job leaves its items in the queue, marked; the
next batch plan skips them, so dropping is O(1) too.

A request is admitted on the rate of that moment; if the engine then slows (another process takes
a core), work still queued may no longer finish within its bound. Every plan checks the queue
against the rate it has just measured (`core/lateness.py`): a request that would now finish past its
bound, or whose inputs are still queued once its bound has passed, is refused (429 with Retry-After) at
once, instead of being answered late.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from itertools import compress

import numpy as np

from embedfleet.runtime.core.admission import decide
from embedfleet.runtime.core.batching import DEFAULT_OVERHEAD_TOKENS, Queued, plan_batch
from embedfleet.runtime.core.bookkeeping import Bookkeeping
from embedfleet.runtime.core.jobs import DeadlineUnmet, Item, Job, QueueFull, scatter
from embedfleet.runtime.core.lateness import late_jobs
from embedfleet.runtime.core.preemption import Preemption
from embedfleet.runtime.metrics import ModelMetrics, track
from embedfleet.runtime.tracing import RequestTrace, trace_batch

log = logging.getLogger(__name__)

MIN_BULK_TOKENS = 512
QUERIES_RECENT_S = 1.0  # urgent work seen this recently: bulk batches are cut to the shared slice
MIN_BULK_SHARE = 0.1  # bulk work is never judged to get less than this share of the engine (promotion)
# a batch of inputs (anything with len()) -> rows: one array (fixed width, stacked per request) or a list
# of arrays (ragged, e.g. per-token vectors: each request gets its list, in input order)
EngineFn = Callable[[list], np.ndarray | list[np.ndarray]]


class BatchManager(Preemption):
    def __init__(self, engine_fn: EngineFn, max_batch_tokens: int, max_batch_requests: int,
                 max_queue_tokens: int, metrics: ModelMetrics, engine_thread: Executor,
                 overhead_tokens: int = DEFAULT_OVERHEAD_TOKENS, bulk_batch_seconds: float = 0.0,
                 shared_batch_seconds: float = 0.0, urgent_wait_s: float = 0.0, packed: bool = False,
                 by_length: bool = False) -> None:
        self.engine_fn = engine_fn
        self.packed = packed  # the engine runs packed sequences: batches cost real tokens (core/batching.py)
        self.by_length = by_length  # ...and its batches' time is their tokens (CPU): short inputs batch together
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.max_queue_tokens = max_queue_tokens
        self.overhead_tokens = overhead_tokens
        self.bulk_batch_seconds = bulk_batch_seconds
        self.shared_batch_seconds = shared_batch_seconds
        self.urgent_wait_s = urgent_wait_s  # --max-queue-seconds: how long promoted bulk work may wait as urgent
        self._last_urgent = float("-inf")  # time.monotonic() of the last urgent submit
        self.metrics = metrics
        self._queue: list[Item] = []
        # the jobs with inputs queued, in submission order (the queue's order of jobs), each with its first
        # item: what expiry, promotion and the lateness check walk instead of every queued input
        self._jobs: dict[Job, Item] = {}
        self._stale = False  # a job was dropped: its items are still in the queue, to be filtered out
        self._queued_tokens = 0  # running totals: see the module docstring
        self._urgent_tokens = 0
        self._running_tokens = 0  # in the engine now
        # a bulk batch handed to the engine thread behind the running bulk one (see `_prefetch`), its tokens
        self._next: tuple[list[Item], bool, float] | None = None  # (the batch, whether bulk, perf_counter posted)
        self._next_tokens = 0
        self._deadline_jobs = 0  # queued jobs with a deadline (nothing is handed over early while there are any)
        self._seq = 0
        # the one thread that ever touches the model (see ModelService.load); an EngineThread hands a batch
        # over without a Future (core/engine_thread.py), any other Executor with one
        self._post = getattr(engine_thread, "post", None) or engine_thread.submit
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(); None: nothing is dispatched
        self._busy = False  # a batch is on the engine thread
        self._kick_pending = False  # a _kick is scheduled on the loop
        self._running_since = 0.0  # time.perf_counter() when the batch in the engine started
        # the drain rate, the tenants' fairness ledger, the urgent arrival rate, the batches' metrics
        self._books = Bookkeeping(metrics, time.monotonic(), packed, overhead_tokens)
        # Preemption (see `preempt_point`): shared with the engine thread under `_preempt_lock`.
        self.preemptible = False  # the engine calls preempt_point between layers (ModelService.load wires it)
        self._stretch = 1.0  # the share of a bulk batch's time between two pauses (1 / its layers)
        self._preempt_lock = threading.Lock()
        self._accepting = False  # a bulk batch is on the engine thread and may be paused for a query's batch
        self._posted: tuple[list[Item], list] | None = None  # the batch to run at the next pause
        self._next_bulk = False  # a bulk batch was handed over behind the running one: it accepts next
        # loop side
        self._bulk_running = False  # the batch on the engine thread is bulk work on a preemptible engine
        self._interrupting = False  # a posted batch is not answered yet (one at a time)
        self._posted_tokens = 0  # its tokens (ahead of every new request, as the running batch's are)
        self._preempt_pending = False  # a _preempt is scheduled on the loop
        # engine thread side
        self._in_interrupt = False
        self._paused_s = 0.0  # of the running bulk batch, spent running posted batches
        self._pause_started = 0.0  # perf_counter() when the posted batch now on the engine started (0: none)
        self._engine_loop: asyncio.AbstractEventLoop | None = None
        metrics.max_batch_requests.set(max_batch_requests)
        metrics.max_batch_tokens.set(max_batch_tokens)
        # Read when scraped, not kept up to date on every submit and batch: a single query on a busy
        # CPU paid for three gauge updates (and an expected-wait computation) several times on its
        # path, and a scrape now sees the state of that moment exactly.
        track(metrics.queue_tokens, lambda: self._queued_tokens)
        track(metrics.queue_requests, lambda: self._queued_jobs)
        track(metrics.expected_wait, self.expected_wait)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._schedule_kick()

    async def stop(self) -> None:
        """No batch is planned after this; the one on the engine thread, and a bulk batch handed over behind
        it (`_prefetch`), finish, and their answers are dropped if the loop has closed by then."""
        self._loop = None

    # -- public ----------------------------------------------------------------------------
    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def tokens_per_s(self) -> float:
        """The long-run drain rate (0 until seeded or measured); admission reads `drain_rate()`."""
        return self._books.tokens_per_s

    @property
    def _tokens_per_s(self) -> float:  # what sizes bulk batches (`_budget`); tests set it
        return self._books.tokens_per_s

    @_tokens_per_s.setter
    def _tokens_per_s(self, value: float) -> None:
        self._books.tokens_per_s = value

    @property
    def _queued_jobs(self) -> int:
        return len(self._jobs)

    @property
    def idle(self) -> bool:
        """Nothing queued, posted or on the engine: the server's own work (the start-up probe) may take the
        engine thread now without delaying a request."""
        return not self._jobs and not self._running_tokens and not self._next_tokens and not self._posted_tokens

    @property
    def saturated(self) -> bool:
        return self._queued_tokens >= self.max_queue_tokens

    def ahead_of(self, urgent: bool) -> int:
        """Tokens the engine runs before a new request of this kind: urgent work only waits for urgent
        work (the planner serves it first) and the batch in the engine, of which only one layer when it is
        a bulk batch that pauses for queries (preemption); bulk work waits for everything, the batch handed
        over behind the running one included (urgent work only when that one is not bulk)."""
        running = self._running_tokens
        if urgent and self._bulk_running:  # it runs at the bulk batch's next pause: at most one layer away
            running = math.ceil(running * self._stretch)
        behind = self._next_tokens if not urgent or (self._next is not None and not self._next[1]) else 0
        return running + self._posted_tokens + behind + (self._urgent_tokens if urgent else self._queued_tokens)

    def urgent_arrival_rate(self, now: float | None = None) -> float:
        """Urgent tokens submitted per second lately (a decayed sum over ARRIVALS_WINDOW_S)."""
        return self._books.urgent_arrival_rate(time.monotonic() if now is None else now)

    def drain_rate(self, urgent: bool = True) -> float:
        """The measured rate (core/drain_rate.py: the most pessimistic of the long-run rate, the last
        seconds' and last batches' rates, and the batch in the engine, which lowers it while it overruns
        it): a machine that just got slower (another process took a core) is believed within a batch.

        For bulk work (`urgent` false), less the rate at which urgent work is arriving: queries go
        first, so queued bulk work drains only with what they leave of the engine (a bulk request with
        Q tokens ahead finishes after Q / (rate - arrivals), not Q / rate). Never below MIN_BULK_SHARE
        of the rate, since bulk work waiting past its promotion time runs as urgent."""
        now = time.perf_counter()
        # the running batch's own time: pauses it spent running queries' batches are not its slowness
        running_s = 0.0
        if self._running_tokens:
            pause = self._pause_started  # a pause under way counts too (read once: the engine thread clears it)
            running_s = max(0.0, now - self._running_since - self._paused_s - (now - pause if pause else 0.0))
        rate = self._books.drain.rate(now, self._running_tokens, running_s)
        if not urgent and rate:
            rate = max(rate - self.urgent_arrival_rate(), MIN_BULK_SHARE * rate)
        return rate

    def expected_wait(self, urgent: bool = False) -> float:
        ahead = self.ahead_of(urgent)
        if not ahead:  # nothing ahead: no wait whatever the rate (the gate asks on every request)
            return 0.0
        rate = self.drain_rate(urgent)
        return ahead / rate if rate else 0.0

    def seed_rate(self, tokens: int, seconds: float) -> None:
        """Start the drain rate from a timed batch (ModelService.load runs one at start-up), so the
        first requests are judged by a measurement instead of being admitted blind."""
        self._books.seed(tokens, seconds)

    def submit(self, inputs: Sequence, urgent: bool, max_wait: float | None = None,
               deadline: float | None = None, tenant: str = "", arrived: float | None = None,
               trace: RequestTrace | None = None, lengths: list[int] | None = None) -> Job:
        """Queue a request's inputs; await `job.future` for the rows in input order.

        Raises QueueFull past the token cap or when the expected wait passes `max_wait` seconds, and
        DeadlineUnmet when it passes `deadline` (a time.monotonic() value). `arrived` (time.monotonic()
        when the server accepted the request): the bound counts from there, so time already spent
        reading, parsing and tokenizing under load is part of the promise. `lengths`: each input's
        `len`, where the caller has them already. Cost: O(len(inputs)).
        """
        if lengths is None:
            lengths = list(map(len, inputs))
        tokens = sum(lengths)
        now = time.monotonic()
        bound = max_wait
        if max_wait is not None and arrived is not None:
            max_wait = max(0.0, max_wait - (now - arrived))
        if self._queued_tokens and self._queued_tokens + tokens > self.max_queue_tokens:
            self.metrics.shed_queue_tokens.inc()
            raise QueueFull(
                f"the queue holds {self._queued_tokens} tokens; adding {tokens} would pass the limit "
                f"of {self.max_queue_tokens}", retry_after=max(1.0, self.expected_wait()))
        remaining = None if deadline is None else deadline - now
        rate = self.drain_rate(urgent)
        ahead = self.ahead_of(urgent)
        decision = decide(ahead, tokens, rate, max_wait, remaining)
        if decision.reason == "deadline":
            self.metrics.shed_deadline.inc()
            raise DeadlineUnmet(
                f"deadline cannot be met: about {decision.expected_s:.2f}s of work is ahead of this request "
                f"and it allows {max(remaining or 0.0, 0.0):.2f}s")
        if not decision.admit:
            self.metrics.shed_expected_wait.inc()
            alone = tokens / rate
            hint = f"; alone it is about {alone:.1f}s of work: split it" if bound and alone > bound else ""
            spent = 0.0 if arrived is None else now - arrived
            waited = f" after {spent:.1f}s already spent" if spent >= 0.1 else ""
            raise QueueFull(
                f"the server is overloaded: this request would finish in about {decision.expected_s:.1f}s"
                f"{waited}, over the bound of {bound:g}s (--max-queue-seconds{'' if urgent else '-bulk'}); retry "
                f"in {decision.retry_after}s{hint}", retry_after=decision.retry_after, reason="expected_wait")
        job = Job(inputs, urgent, asyncio.get_running_loop().create_future(), remaining=len(inputs),
                  deadline=deadline, queued_tokens=tokens,
                  queued_items=len(inputs), promote_at=None if urgent or max_wait is None else
                  now + self._promote_after(max_wait, tokens, self.drain_rate()), tenant=tenant, admitted_at=now,
                  trace=trace, bound=bound, promised=None if max_wait is None else now + max_wait,
                  alone=not ahead and max_wait is not None and decision.expected_s > max_wait)
        seq = self._seq
        items = [Item(job, i, seq + i, length) for i, length in enumerate(lengths)]
        self._seq += len(items)
        self._queue += items
        self._jobs[job] = items[0]
        self._deadline_jobs += deadline is not None
        self._queued_tokens += tokens
        if urgent:
            self._urgent_tokens += tokens
            self._last_urgent = now
            self._books.urgent_arrived(tokens, now)
        self._schedule_kick()
        return job

    def _promote_after(self, max_wait: float, tokens: int, rate: float) -> float:
        """Seconds until bulk work still queued is promoted to urgent: early enough that, once promoted,
        it waits at most as long as a query may (the urgent bound) and then runs, and still finishes
        within its own bound, less a tenth of the bound for the estimates' error. Promoted work joins
        the urgent queue at its back (see `_live_queue`), so the queries already admitted keep their
        promise too. Never before half the bound: a request that alone is most of the bound (admitted
        on an empty queue) would otherwise go ahead of every query at once."""
        own = tokens / rate if rate else 0.0
        return max(0.5 * max_wait, 0.9 * max_wait - own - self.urgent_wait_s)

    def cancel(self, job: Job) -> None:
        """The client went away: its queued inputs never reach the engine (those already on the engine
        thread, in the running batch or a bulk batch handed over behind it, still run)."""
        if job.future.done():
            return
        job.cancelled = True
        self._drop(job)
        job.future.cancel()

    def expire(self, job: Job) -> None:
        """The job's deadline passed: its queued inputs never reach the engine; it is answered 504."""
        if job.future.done():
            return
        self._drop(job)
        self.metrics.expired.inc()
        job.future.set_exception(DeadlineUnmet("deadline passed while the request waited for the engine; "
                                               "it was not run"))

    def _drop(self, job: Job) -> None:
        """Take the job's waiting tokens off the totals; its items stay queued, marked, until the
        next plan skips them (O(1) here instead of a scan of the queue)."""
        if job.dropped:
            return
        job.dropped = True
        self._queued_tokens -= job.queued_tokens
        if job.urgent:
            self._urgent_tokens -= job.queued_tokens
        if self._jobs.pop(job, None) is not None:
            self._deadline_jobs -= job.deadline is not None
            self._stale = True
        job.queued_tokens = job.queued_items = 0

    # -- scheduler -------------------------------------------------------------------------
    def _budget(self, entries: Sequence[Queued]) -> int:
        """Urgent batches may use the whole token budget; bulk ones are cut to `bulk_batch_seconds` of
        measured engine time, so a query arriving mid-backfill never waits behind a long batch. While
        queries are arriving (one in the last QUERIES_RECENT_S), bulk batches are cut further, to
        `shared_batch_seconds`: the batch in the engine is what the next query waits for, and a backfill
        then trades some throughput for the queries' latency. An engine that pauses between layers for
        queries (preemption) makes a query wait one layer of a bulk batch, not all of it: its bulk batches
        are then sized so that one layer takes those seconds (whole-batch budgets made bulk batches of a
        few inputs on two CPU cores, each paying the call's fixed cost)."""
        if not self.bulk_batch_seconds or not self._tokens_per_s or any(e.urgent for e in entries):
            return self.max_batch_tokens
        seconds, floor = self.bulk_batch_seconds, MIN_BULK_TOKENS  # never starve bulk work into tiny batches
        if self.shared_batch_seconds and time.monotonic() - self._last_urgent < QUERIES_RECENT_S:
            seconds, floor = min(seconds, self.shared_batch_seconds), 2 * self.overhead_tokens
        if self.preemptible:  # what a query waits behind is one stretch of the batch (`ahead_of` counts so)
            seconds /= self._stretch
        floor = min(self.max_batch_tokens, floor)
        return max(floor, min(self.max_batch_tokens, int(seconds * self._tokens_per_s)))

    def _live_queue(self) -> list[Item]:
        """The queue without dropped jobs' items; jobs whose deadline has passed are expired here, so
        the planner never hands the engine work nobody will read. Bulk jobs still queued at their
        `promote_at` are promoted to urgent: a steady stream of queries (which go first) would otherwise
        starve them. They join the urgent queue at its back (new sequence numbers), not at their old
        place: queries admitted meanwhile were promised a wait that did not count them.

        Expiry and promotion are decided per job (a job's inputs share its deadline and its promotion), so
        a plan walks the queued jobs, not the queued inputs; the inputs are walked only when some job was
        dropped (to filter its items out) or promoted (to renumber them)."""
        now = time.monotonic()
        promoted: set[Job] = set()
        for job in list(self._jobs):
            if job.deadline is not None and job.deadline <= now:
                self.expire(job)
                if job.dropped:
                    continue
            if not job.urgent and job.promote_at is not None and job.promote_at <= now:
                job.urgent = True
                self._urgent_tokens += job.queued_tokens
                promoted.add(job)
        self._refuse_late(now)
        if self._stale:
            self._stale = False
            self._queue = [item for item in self._queue if not item.job.dropped]
        if promoted:  # new sequence numbers in queue order: the back of the urgent queue
            for item in self._queue:
                if item.job in promoted:
                    item.renumber(self._seq)
                    self._seq += 1
        return self._queue

    def _refuse_late(self, now: float) -> None:
        """Refuse (429) the bounded queued jobs that `late_jobs` finds would be answered later than their
        bound plus the batch they run in (admitted on a rate the engine no longer keeps: it slowed since). It is given
        one item per job, the jobs in queue order: all it reads of an item is its job."""
        urgent_ahead = self.ahead_of(urgent=True) - self._urgent_tokens
        bulk_ahead = self.ahead_of(urgent=False) - self._queued_tokens  # of the batches in the engine
        late = late_jobs(list(self._jobs.values()), now, urgent_ahead, bulk_ahead, self._urgent_tokens,
                         self._books.last_batch_s, lambda: (self.drain_rate(True), self.drain_rate(False)))
        for job, ahead, rate in late:
            finish = now - job.admitted_at + ((ahead + job.queued_tokens) / rate if rate else 0.0)
            retry = decide(ahead, job.queued_tokens, rate, job.bound).retry_after or 1
            self._drop(job)
            self.metrics.shed_expected_wait.inc()
            job.future.set_exception(QueueFull(
                f"the server is overloaded: the engine slowed after this request was admitted, and it would "
                f"finish after about {finish:.1f}s, over the bound of {job.bound:g}s "
                f"(--max-queue-seconds{'' if job.urgent else '-bulk'}); retry in {retry}s",
                retry_after=retry, reason="expected_wait"))

    def _plan(self) -> list[Item]:
        """The next batch, taken off the queue with admission's running totals updated."""
        self._queue = self._live_queue()
        if not self._queue:
            return []
        queue = self._queue  # each Item is its own planner entry
        chosen = sorted(plan_batch(queue, self._budget(queue), self.max_batch_requests, self.overhead_tokens,
                                   self._books.served, self.packed, self.by_length))
        batch = [queue[i] for i in chosen]
        keep = [True] * len(queue)
        for i in chosen:
            keep[i] = False
        self._queue = list(compress(queue, keep))
        for item in batch:
            job, length = item.job, item.length
            job.queued_tokens -= length
            job.queued_items -= 1
            self._queued_tokens -= length
            if job.urgent:
                self._urgent_tokens -= length
            if job.queued_items == 0:
                del self._jobs[job]
                self._deadline_jobs -= job.deadline is not None
        return batch

    def _running(self, batch: list[Item]) -> None:
        """`batch` is the engine's batch now (admission counts it as ahead of every request)."""
        self._running_tokens = sum(item.length for item in batch)
        self._running_since, self._paused_s = time.perf_counter(), 0.0

    def _take_batch(self) -> list[Item]:
        """Plan a batch and do its bookkeeping at once (the scheduler does the bookkeeping while the
        engine runs the batch)."""
        batch = self._plan()
        self._running(batch)
        self._account(batch)
        return batch

    def _account(self, batch: list[Item]) -> None:
        """What taking `batch` means for everything but admission's totals (which `_plan` keeps): the
        tenants' fairness ledger (read by the next plan), queue-wait metrics, traces."""
        self._books.taken(batch, time.monotonic())

    def _schedule_kick(self) -> None:
        """Plan on the next loop turn, not now: requests tokenized in the same turn share the batch.
        With the engine running bulk work, urgent work queued is planned to run at its next pause, and
        bulk work, when nothing is handed over behind it yet, to run after it (`_prefetch`)."""
        if self._loop is None:
            return
        if not self._busy or (self._bulk_running and self._next is None and not self._urgent_tokens
                              and not self._deadline_jobs):
            if not self._kick_pending:
                self._kick_pending = True
                self._loop.call_soon(self._kick)
        elif self._bulk_running and self._urgent_tokens and not self._interrupting and not self._preempt_pending:
            self._preempt_pending = True
            self._loop.call_soon(self._preempt)

    def _kick(self) -> None:
        """If the engine is free, hand it the next batch; the bookkeeping runs once it is computing."""
        self._kick_pending = False
        if self._loop is None:
            return
        if self._busy:
            self._prefetch()
            return
        batch = self._plan()
        if not batch:
            self._books.last_end = None  # idle time is not drain time
            self._account(batch)
            return
        inputs = [item.job.inputs[item.index] for item in batch]
        bulk = self.preemptible and not any(item.job.urgent for item in batch)
        if bulk:
            with self._preempt_lock:
                self._accepting = True  # the engine thread ends it, under the lock, when the batch is done
        self._bulk_running = bulk
        self._running(batch)
        self._post(self._compute, self._loop, batch, inputs)
        self._busy = True  # after submit: _finish runs on this loop, so never before this line
        self._account(batch)
        if bulk and self._urgent_tokens:  # promoted work, or urgent work the planner left for a tenant's turn
            self._schedule_kick()
        else:
            self._prefetch()

    def _run_engine(self, inputs: list) -> tuple[np.ndarray | list[np.ndarray] | None, BaseException | None]:
        """On the engine thread: the batch's rows, or the error that the loop fails the batch's requests with
        (never lost here, never raised into the engine thread's executor)."""
        try:
            rows = self.engine_fn(inputs)
            if len(rows) != len(inputs):
                raise RuntimeError(f"the engine returned {len(rows)} rows for a batch of {len(inputs)} inputs")
            return rows, None
        except BaseException as exc:
            return None, exc

    def _compute(self, loop: asyncio.AbstractEventLoop, batch: list[Item], inputs: list) -> None:
        """On the engine thread: run the batch, time it, and hand the rows (or the error) to the loop."""
        self._engine_loop, self._paused_s = loop, 0.0
        started = time.perf_counter()
        rows, error = self._run_engine(inputs)
        ended = time.perf_counter()
        paused, free = self._paused_s, ended
        if self.preemptible:
            with self._preempt_lock:
                self._accepting, self._next_bulk = self._next_bulk, False  # the batch handed over behind it
                posted, self._posted = self._posted, None
            if posted is not None:  # posted after the last pause: it goes before this batch's answer
                self._run_posted(*posted)
                free = time.perf_counter()  # its time is its own in the drain rate, not the next gap's
        try:
            loop.call_soon_threadsafe(self._finish, batch, inputs, rows, error, started, ended, paused, free)
        except RuntimeError:  # the loop closed while this batch ran (shutdown): nobody is waiting
            pass

    def _finish(self, batch: list[Item], inputs: list, rows, error: BaseException | None, started: float,
                ended: float, paused: float = 0.0, free: float | None = None) -> None:
        """On the loop: hand the engine its next batch, complete the requests whose rows are all in, and
        (next turn, after their answers) do the bookkeeping. `paused`: of ended - started, the time spent
        running posted batches (preemption), which is not this batch's; `free`: when the engine was free
        for the next batch (after a batch posted too late for a pause ran; default `ended`).

        The engine's next batch goes first: planning it takes tens of microseconds, while the answers' handlers
        (which run before anything queued after them) encode their responses, a millisecond or more for a
        bulk request. Answers first left the engine idle for that time after every batch."""
        if self._next is not None:  # the batch handed over behind this one started when this one ended
            (running, self._bulk_running, posted), self._next = self._next, None
            self._running_tokens, self._next_tokens = self._next_tokens, 0
            # when it started: this one's end, or its own hand-over where that came later (its pauses are the
            # engine thread's to count)
            self._running_since = max(free if free is not None else ended, posted)
            self._account(running)  # its queue wait ends now, not when it was handed over
        else:
            self._busy = False
            self._bulk_running = False
            self._running_tokens = 0
        if error is not None:
            self._books.last_end = None
            self._deliver(batch, rows, error, started, ended, paused)
            self._schedule_kick()
            return
        waiting = bool(self._queued_tokens)  # before the next batch leaves the queue: the gap is drain time
        self._kick()
        self._deliver(batch, rows, error, started, ended, paused)
        if self._loop is not None:
            self._loop.call_soon(self._after, batch, inputs, started, ended, paused, True, free, waiting)

    def _deliver(self, batch: list[Item], rows, error: BaseException | None, started: float, ended: float,
                 paused: float = 0.0) -> None:
        """Complete the futures of the batch's requests whose rows are all in; with `error` (the engine
        failed this batch), fail its requests instead: the server keeps serving. A job's queue time ends
        when its first batch started on the engine (a query run in a pause waited for the pause too)."""
        if error is not None:
            log.error("engine failed a batch of %d inputs", len(batch), exc_info=error)
            self.metrics.engine_failures.inc()  # a batch run in a pause (preemption) too
            for item in batch:
                if not item.job.future.done():
                    item.job.future.set_exception(error)
            return
        on_engine = started + (time.monotonic() - time.perf_counter())  # the start on the admission clock
        if isinstance(rows, np.ndarray):
            scatter(batch, rows, started, ended - started - paused, on_engine)
            return
        for item, row in zip(batch, rows, strict=True):  # ragged rows: each request gets its list
            job = item.job
            if job.future.done():
                continue
            job.ran(started, ended - started - paused, on_engine)
            if not job.results:
                job.results = [None] * len(job.inputs)
            job.results[item.index] = row
            job.remaining -= 1
            if job.remaining == 0:
                job.future.set_result(job.results)

    def _after(self, batch: list[Item], inputs: list, started: float, ended: float, paused: float,
               scheduled: bool, free: float | None = None, waiting: bool | None = None) -> None:
        """Bookkeeping of a batch answered last turn; `scheduled`: it was the engine's batch (not one run
        during a pause), so the next batch is planned now if `_finish` found none to plan; `waiting`: work
        was queued when the batch ended (default: whether it is now)."""
        if waiting is None:
            waiting = bool(self._queued_tokens)
        self._books.record(batch, started, ended, paused, scheduled, waiting=waiting, free=free)
        if any(item.job.trace is not None for item in batch):  # tracing on (tracing.py); answers are out
            trace_batch([(item.job.trace, item.length) for item in batch], started + paused, ended, self.packed)
        if scheduled:
            self._kick()
        else:
            self._schedule_kick()

    def _observe(self, ended: float, tokens: int, seconds: float) -> None:
        """One batch into the drain rate (core/bookkeeping.py); tests feed it measurements."""
        self._books.observe(ended, tokens, seconds)
