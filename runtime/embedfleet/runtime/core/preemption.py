"""The batch manager's hand-overs to an engine that pauses between layers (mixed into `BatchManager`).

`Preemption` holds no state of its own: its methods read and write the manager's (core/batcher.py), on the
event loop or, where a docstring says so, on the engine thread under `_preempt_lock`. Two hand-overs:

- a query's batch, posted for the running bulk batch's next pause (`_preempt`, `preempt_point`);
- the next bulk batch, queued on the engine thread behind the running one (`_prefetch`).
"""

from __future__ import annotations

import time

from embedfleet.runtime.core.jobs import Item


class Preemption:
    """Mixed into `BatchManager`; see the module docstring."""

    def _prefetch(self) -> None:
        """With a bulk batch on a preemptible engine and no urgent work queued, hand the engine thread the
        next bulk batch too, so that it starts it the moment the running one ends. Planned on the loop
        only once the running batch's answer came back, the next batch waited for the loop to take its
        turn and for the engine thread to wake and get a core back from whatever ran meanwhile (the
        answers' encoding, the next requests' parsing and tokenizing, the clients): a millisecond or more
        between batches on two cores, up to a scheduler slice. Queries lose nothing: one arriving later
        runs at the next pause of whichever bulk batch is running (`preempt_point`), and the one handed
        over keeps taking them from its start; a query that arrives between the two, which would have run
        next, waits up to one layer of the one handed over. Bulk work that arrives after the hand-over
        (another tenant's, say) waits one batch longer, and work handed over runs even if its client leaves,
        as the running batch's does. While a queued request has a deadline (`x-request-timeout`), nothing is
        handed over early: only queued work is dropped when its deadline passes (504, never run). Its queue
        wait (metrics, traces) ends when it starts, in `_finish`."""
        if (self._loop is None or not self._bulk_running or self._next is not None or self._urgent_tokens
                or self._deadline_jobs):  # (work handed over is never expired: with a deadline queued, none is)
            return
        self._live_queue()  # (promotes bulk work that reached its time: it then goes at the next pause)
        if self._urgent_tokens:
            self._schedule_kick()
            return
        batch = self._plan()
        if not batch:
            return
        bulk = not any(item.job.urgent for item in batch)
        with self._preempt_lock:
            if self._accepting:  # the running batch hands its acceptance over when it ends
                self._next_bulk = bulk
            else:  # it has ended already (its answer is on the way): this batch is the engine's next at once
                self._accepting = bulk
        self._next = (batch, bulk, time.perf_counter())
        self._next_tokens = sum(item.length for item in batch)
        self._post(self._compute, self._loop, batch, [item.job.inputs[item.index] for item in batch])

    # -- preemption ------------------------------------------------------------------------
    # The engine cannot be interrupted mid-layer, but on CPU it can pause between layers: a query that
    # arrives while a long bulk batch runs then waits one layer of it, not all of it (a 280-token passage
    # is 40 ms of a 2-core CPU; one of its six layers, 7 ms). The loop plans the query's batch as soon as
    # it is queued and posts it; the engine thread, at the next layer boundary of the bulk batch, runs it
    # to the end, hands its rows to the loop and resumes the bulk batch, whose activations were kept.
    # One posted batch at a time; a bulk batch that ends before taking it runs it before its own rows go
    # back. Bulk batches' engine time excludes the pauses (drain rate, metrics, jobs' inference time).

    def preemptible_in(self, stretches: int) -> None:
        """The engine calls `preempt_point` between the `stretches` parts of every forward pass."""
        self.preemptible = True
        self._stretch = 1.0 / max(1, stretches)

    def _preempt(self) -> None:
        """On the loop: post the next urgent batch for the engine's next pause, if the bulk batch running
        still takes one."""
        self._preempt_pending = False
        if self._loop is None or not self._bulk_running or self._interrupting or not self._urgent_tokens:
            return
        with self._preempt_lock:
            if not self._accepting:  # the bulk batch is done: its _finish plans the queued work next
                return
            batch = self._plan()
            if not batch:
                return
            self._posted = (batch, [item.job.inputs[item.index] for item in batch])
        self._interrupting = True
        self._posted_tokens = sum(item.length for item in batch)
        self._account(batch)

    def preempt_point(self) -> None:
        """On the engine thread, between two layers of whatever batch runs: run the posted batch, if any.
        Costs an attribute read when nothing is posted."""
        if self._posted is None or self._in_interrupt:
            return
        with self._preempt_lock:
            posted, self._posted = self._posted, None
        if posted is not None:
            self._run_posted(*posted)

    def _run_posted(self, batch: list[Item], inputs: list) -> None:
        self._in_interrupt = True  # its own layers' pauses do nothing
        started = self._pause_started = time.perf_counter()
        try:
            rows, error = self._run_engine(inputs)
        finally:
            self._in_interrupt = False
        ended = time.perf_counter()
        self._pause_started = 0.0  # cleared before it is added: a read between the two counts it in neither
        self._paused_s += ended - started
        try:
            assert self._engine_loop is not None
            self._engine_loop.call_soon_threadsafe(self._finish_posted, batch, inputs, rows, error, started, ended)
        except RuntimeError:  # the loop closed meanwhile (shutdown): nobody is waiting
            pass

    def _finish_posted(self, batch: list[Item], inputs: list, rows, error: BaseException | None, started: float,
                       ended: float) -> None:
        """On the loop: answer a batch run during a pause; the bulk batch is still on the engine."""
        self._interrupting = False
        self._posted_tokens = 0
        self.metrics.preempted.inc()
        self._deliver(batch, rows, error, started, ended)
        if error is None and self._loop is not None:
            self._loop.call_soon(self._after, batch, inputs, started, ended, 0.0, False)
        else:
            self._schedule_kick()
