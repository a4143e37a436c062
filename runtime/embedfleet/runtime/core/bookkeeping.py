"""What the batch manager (batcher.py) learns from the work it runs, and what it records about it: the
engine's drain rate, the tenants' recent engine time (the fairness ledger the planner reads), the rate
at which urgent work arrives, and the Prometheus metrics of each batch.

Kept apart from the scheduler because none of it decides, by itself, what runs next: it is bookkeeping,
done while the engine computes a batch or after that batch's answers are out, and the scheduler only
reads its figures (admission and the bulk batch size read the rates, the planner reads the ledger). It
reads no clock: the manager passes its times in (``time.monotonic()`` for arrivals and the ledger,
``time.perf_counter()`` for the engine's batches), so that the manager's clock is the only one.
"""

from __future__ import annotations

import math

from embedfleet.runtime.core.batching import batch_cost
from embedfleet.runtime.core.drain_rate import DrainRate
from embedfleet.runtime.core.jobs import Item
from embedfleet.runtime.metrics import ModelMetrics

SERVED_WINDOW_S = 10.0  # tenants' fair shares are judged over about this much recent engine time
ARRIVALS_WINDOW_S = 5.0  # the urgent arrival rate is measured over about this much recent time


class Bookkeeping:
    """The running figures of one batch manager and the metrics of its batches."""

    def __init__(self, metrics: ModelMetrics, now: float, packed: bool = False, overhead_tokens: int = 0) -> None:
        """`now`: time.monotonic(), where the decayed sums start; `packed`: the engine pads nothing, so a
        batch's tokens are its real ones (embedfleet_batch_tokens); `overhead_tokens`: one engine call's
        fixed cost in tokens (--batch-overhead-tokens): batches smaller than it stay out of the drain rate."""
        self.metrics = metrics
        self.packed = packed
        self.overhead_tokens = overhead_tokens
        self.drain = DrainRate()  # clock: time.perf_counter()
        self.tokens_per_s = 0.0  # the long-run rate (sizes bulk batches)
        self.last_end: float | None = None  # when the last batch finished, if work was waiting then
        self.last_batch_s = 0.0  # the drain seconds of the last batch (the promise's "one batch")
        self.longest_batch = 0.0  # the longest wall time of one batch (embedfleet_batch_seconds_max)
        self.served: dict[str, float] = {}  # tokens run per tenant, decayed over SERVED_WINDOW_S
        self._served_at = now
        self._urgent_arrivals = 0.0  # urgent tokens submitted, decayed over ARRIVALS_WINDOW_S
        self._arrivals_at = now

    # -- urgent arrivals (time.monotonic()) ------------------------------------------------
    def urgent_arrival_rate(self, now: float) -> float:
        """Urgent tokens submitted per second lately (a decayed sum over ARRIVALS_WINDOW_S)."""
        return self._urgent_arrivals * math.exp(-(now - self._arrivals_at) / ARRIVALS_WINDOW_S) / ARRIVALS_WINDOW_S

    def urgent_arrived(self, tokens: int, now: float) -> None:
        self._urgent_arrivals = self.urgent_arrival_rate(now) * ARRIVALS_WINDOW_S + tokens
        self._arrivals_at = now

    # -- the drain rate (time.perf_counter()) ----------------------------------------------
    def seed(self, tokens: int, seconds: float) -> None:
        self.drain.seed(tokens, seconds)
        self.tokens_per_s = self.drain.long_run

    def observe(self, ended: float, tokens: int, seconds: float) -> None:
        """One batch into the drain rate (core/drain_rate.py): `tokens` left the engine at `ended`
        (time.perf_counter()) after `seconds` of draining."""
        self.drain.observe(ended, tokens, seconds)
        self.last_batch_s = seconds
        self.tokens_per_s = self.drain.long_run

    # -- batches ---------------------------------------------------------------------------
    def taken(self, batch: list[Item], now: float) -> None:
        """What taking `batch` off the queue at `now` (time.monotonic()) means for everything but
        admission's totals (which the manager's plan keeps): the tenants' fairness ledger (read by the
        next plan), queue-wait metrics, traces."""
        self._decay_served(now)
        for item in batch:
            job = item.job
            self.served[job.tenant] = self.served.get(job.tenant, 0.0) + item.length
            if job.trace is not None:
                job.trace.dequeued()
        for job in {item.job: None for item in batch if item.job.queued_items == 0}:
            self.metrics.queue_wait(job.tenant or "default").observe(now - job.admitted_at)

    def _decay_served(self, now: float) -> None:
        """Forget old service so that a tenant's turn depends on recent engine time only; tenants that
        have faded out are dropped (the dict stays as small as the set of active tenants)."""
        keep = math.exp(-(now - self._served_at) / SERVED_WINDOW_S)
        self._served_at = now
        self.served = {t: v * keep for t, v in self.served.items() if v * keep >= 1.0}

    def record(self, batch: list[Item], started: float, ended: float, paused: float, scheduled: bool,
               waiting: bool, free: float | None = None) -> None:
        """The metrics and the drain rate of a batch answered (times: time.perf_counter()); `scheduled`:
        it was the engine's batch, not one run during a pause; `waiting`: work is queued now; `free`: when
        the engine was free for the next batch (default `ended`; later when a batch run after this one's
        forward, with its own time in the rate, held it). Lengths are the items' own (measured once, at
        submit), not the inputs' measured again."""
        lengths = [item.length for item in batch]
        tokens = sum(lengths)
        self.metrics.batch_size.observe(len(batch))
        self.metrics.batch_tokens.observe(batch_cost(lengths, self.packed))
        self.metrics.inputs.inc(len(batch))
        self.metrics.tokens.inc(tokens)
        self.metrics.engine_busy.inc(ended - started - paused)
        self.metrics.batch_seconds.observe(ended - started)
        if ended - started > self.longest_batch:
            self.longest_batch = ended - started
            self.metrics.batch_seconds_max.set(self.longest_batch)
        # batches smaller than one call's fixed cost stay out of the drain rate (why: core/drain_rate.py)
        small = tokens < self.overhead_tokens
        if not scheduled:  # run during a pause: its own time only (the pause is not the bulk batch's)
            if not small:
                self.observe(ended, tokens, ended - started)
            return
        # The drain rate counts the gap since the previous batch when work was already waiting then:
        # time the event loop spent before it could plan this batch drains nothing either.
        since = self.last_end if self.last_end is not None else started
        if not small:
            self.observe(ended, tokens, ended - since - paused)
        self.last_end = (ended if free is None else free) if waiting else None
