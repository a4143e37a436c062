"""Which queued jobs a slowed engine would answer past their bound, as one pure function.

A request is admitted on the drain rate of that moment; if the engine then slows (another process takes
a core), work still queued may no longer finish within its bound. The batch manager asks this at every
plan and refuses (429) what it returns, rather than answering it late.
"""

from __future__ import annotations

from collections.abc import Callable

from embedfleet.runtime.core.jobs import Item, Job


def late_jobs(live: list[Item], now: float, urgent_ahead: int, bulk_ahead: int, urgent_queued: int,
              last_batch_s: float, rates: Callable[[], tuple[float, float]]) -> list[tuple[Job, int, float]]:
    """The bounded jobs of `live` (queue order) that would be answered later than their bound plus the
    batch they run in, each with the tokens ahead of it and the rate it was judged by. It is asked at every
    batch plan, i.e. when a batch is about to start.

    Two rules. A job with inputs still queued once its promise has passed: its next batch would start after
    the promise, and end past it by that whole batch (whether it has started, and whether work is still
    ahead of it). An urgent job not started that, at the rate measured now (`rates()`: urgent, bulk), would
    finish past its promise, whether work is still ahead of it or it is next (its own inputs, split over
    batches at the pace the engine keeps now, would end past it; started, it would be answered late).
    So the last batch of an accepted job starts before its promise, and the job is answered within its
    bound plus that batch.

    Bulk work waiting as bulk is never refused by the second rule (promotion keeps its bound; promoted, it
    is urgent and judged), nor a job whose deadline comes before its bound (it expires instead). A job
    that alone was expected to take longer than its bound (`alone`: admitted only because nothing was ahead
    of it, as an empty queue admits a request whatever its bound) was promised nothing it could keep: it is
    refused only with work ahead of it one batch (`last_batch_s`) past its promise (queries that arrived
    after it and go first). Work ahead is
    counted as the planner serves it: `urgent_ahead` and `bulk_ahead` are what each class waits for of the
    batches in the engine, and queued urgent work (`urgent_queued` tokens) goes before any bulk job.
    `rates` is called only when some job is judged. Cost: O(len(live)).
    """
    judged_rates: tuple[float, float] | None = None
    late: list[tuple[Job, int, float]] = []
    seen: set[int] = set()
    for item in live:
        job = item.job
        if id(job) in seen:
            continue
        seen.add(id(job))
        ahead = urgent_ahead if job.urgent else bulk_ahead + urgent_queued
        promised = job.promised
        if promised is not None and (job.deadline is None or job.deadline > promised):
            unstarted = job.queued_items == len(job.inputs)
            passed = bool(ahead) and now > promised + last_batch_s if job.alone else now > promised
            judged = job.urgent and unstarted and (bool(ahead) or not job.alone)
            if passed or judged:
                if judged_rates is None:
                    judged_rates = rates()
                rate = judged_rates[0] if job.urgent else judged_rates[1]
                if passed or (rate and now + (ahead + job.queued_tokens) / rate > promised):
                    late.append((job, ahead, rate))
                    continue
        if job.urgent:
            urgent_ahead += job.queued_tokens
        else:
            bulk_ahead += job.queued_tokens
    return late
