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
    """The bounded jobs of `live` (queue order) that would be answered later than their bound plus one
    batch, each with the tokens ahead of it and the rate it was judged by.

    Three rules: a job with work still ahead of it whose promise passed more than one batch (`last_batch_s`)
    ago; an urgent job not started that, at the rate measured now (`rates()`: urgent, bulk), would finish
    past its promise; a job not started with nothing ahead whose promise has already passed (the batches
    ahead of it overran the rate it was judged by: run now, it would end a whole batch past its promise).
    Bulk work is never refused by the second rule (promotion keeps its bound), nor a job whose deadline
    comes before its bound (it expires instead), nor one admitted with nothing ahead (an empty queue admits
    a request whatever its bound, so its promise may have passed before any batch ran). Work ahead is
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
            passed = now > promised + last_batch_s if ahead else unstarted and not job.alone and now > promised
            judged = bool(ahead) and job.urgent and unstarted
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
