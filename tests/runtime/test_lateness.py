"""core/lateness.py: which queued jobs a slowed engine would answer past their bound plus one batch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.core.jobs import Item, Job
from embedfleet.runtime.core.lateness import late_jobs


def job(tokens: int, urgent: bool, promised: float | None, deadline: float | None = None) -> Job:
    return Job(inputs=[[0] * tokens], urgent=urgent, future=None, remaining=1,  # type: ignore[arg-type]
               promised=promised, deadline=deadline, queued_tokens=tokens, queued_items=1)


def items(*jobs: Job) -> list[Item]:
    return [Item(j, 0, seq) for seq, j in enumerate(jobs)]


def test_a_query_behind_work_that_the_measured_rate_cannot_finish_by_its_promise_is_late():
    ahead, behind = job(100, True, promised=100.0), job(100, True, promised=1.5)
    late = late_jobs(items(ahead, behind), now=0.0, urgent_ahead=0, bulk_ahead=0, urgent_queued=200,
                     last_batch_s=0.5, rates=lambda: (100.0, 100.0))
    assert [j for j, _, _ in late] == [behind]  # 2 s of work before it ends, promised at 1.5 s
    assert late[0][1] == 100  # the tokens ahead of it


def test_nothing_ahead_runs_next_while_its_own_work_fits_its_promise():
    nxt = job(50, True, promised=10.0)
    assert late_jobs(items(nxt), now=5.0, urgent_ahead=0, bulk_ahead=0, urgent_queued=50, last_batch_s=0.1,
                     rates=lambda: (10.0, 10.0)) == []  # 5 s of its own work, ends at its promise


def test_next_in_line_whose_own_work_overruns_its_promise_is_late():
    """A bulk request promoted to urgent (or a query) that reaches the head of the queue on an engine slowed
    since it was admitted: its own inputs, at the pace the engine keeps now, end past its promise. Started,
    it could no longer be refused; so it is refused now. One admitted alone keeps its place."""
    promoted, alone = job(374, True, promised=5.98), job(374, True, promised=5.98)
    alone.alone = True
    late = late_jobs(items(promoted), now=4.07, urgent_ahead=0, bulk_ahead=0, urgent_queued=374, last_batch_s=1.6,
                     rates=lambda: (106.0, 106.0))
    assert [(j, ahead) for j, ahead, _ in late] == [(promoted, 0)]  # 3.5 s of its own work, 1.9 s left
    assert late_jobs(items(alone), now=4.07, urgent_ahead=0, bulk_ahead=0, urgent_queued=374, last_batch_s=1.6,
                     rates=lambda: (106.0, 106.0)) == []


def test_bulk_work_waiting_as_bulk_is_left_to_its_promotion():
    bulk = job(374, False, promised=5.98)
    assert late_jobs(items(bulk), now=4.07, urgent_ahead=0, bulk_ahead=0, urgent_queued=0, last_batch_s=1.6,
                     rates=lambda: (106.0, 106.0)) == []


def test_nothing_ahead_past_its_promise_is_late_unless_admitted_alone():
    """The batches ahead of it overran: run now, it would end a whole batch past its promise. A request
    admitted on an empty queue was promised nothing it could keep, and runs."""
    overrun, alone = job(50, True, promised=9.0), job(50, False, promised=0.0)
    alone.alone = True
    late = late_jobs(items(overrun), now=10.0, urgent_ahead=0, bulk_ahead=0, urgent_queued=50, last_batch_s=0.1,
                     rates=lambda: (1.0, 1.0))
    assert [(j, ahead) for j, ahead, _ in late] == [(overrun, 0)]
    assert late_jobs(items(alone), now=10.0, urgent_ahead=0, bulk_ahead=0, urgent_queued=0, last_batch_s=0.1,
                     rates=lambda: (1.0, 1.0)) == []


def started(promised: float) -> Job:
    return Job(inputs=[[0] * 10, [0] * 10], urgent=False, future=None, remaining=1,  # type: ignore[arg-type]
               promised=promised, queued_tokens=10, queued_items=1)


def test_a_started_job_with_inputs_queued_past_its_promise_is_late():
    """Its next batch would start after its promise and end past it by that batch: the second batch of a
    bulk request on an engine that slowed after its first. Before its promise it runs on."""
    job_ = started(promised=6.0)
    late = late_jobs(items(job_), now=6.5, urgent_ahead=0, bulk_ahead=0, urgent_queued=0, last_batch_s=3.0,
                     rates=lambda: (1.0, 1.0))
    assert [j for j, _, _ in late] == [job_]
    assert late_jobs(items(started(promised=6.0)), now=5.9, urgent_ahead=0, bulk_ahead=0, urgent_queued=0,
                     last_batch_s=3.0, rates=lambda: (1.0, 1.0)) == []


def test_a_started_job_admitted_alone_is_finished():
    alone = started(promised=1.0)
    alone.alone = True
    assert late_jobs(items(alone), now=10.0, urgent_ahead=0, bulk_ahead=0, urgent_queued=0, last_batch_s=0.1,
                     rates=lambda: (1.0, 1.0)) == []


def test_a_deadline_before_the_promise_is_left_to_expire():
    first, second = job(100, True, promised=50.0), job(100, True, promised=0.5, deadline=0.2)
    assert late_jobs(items(first, second), now=0.0, urgent_ahead=0, bulk_ahead=0, urgent_queued=200,
                     last_batch_s=0.1, rates=lambda: (10.0, 10.0)) == []


@given(st.lists(st.tuples(st.integers(1, 500), st.booleans(), st.floats(0, 20)), min_size=1, max_size=12),
       st.floats(0, 20), st.floats(0.01, 1000))
def test_the_first_urgent_job_with_nothing_ahead_is_late_only_if_its_own_work_ends_past_its_promise(specs, now, rate):
    jobs = [job(t, u, p) for t, u, p in specs]
    queued_urgent = sum(j.queued_tokens for j in jobs if j.urgent)
    late = late_jobs(items(*jobs), now=now, urgent_ahead=0, bulk_ahead=0, urgent_queued=queued_urgent,
                     last_batch_s=0.1, rates=lambda: (rate, rate))
    first_urgent = next((j for j in jobs if j.urgent), None)
    if first_urgent is not None:
        ends = now + first_urgent.queued_tokens / rate
        assert any(j is first_urgent for j, _, _ in late) == (ends > first_urgent.promised)
    assert all(ahead > 0 or now + j.queued_tokens / rate > j.promised for j, ahead, _ in late), \
        "nothing ahead: late only if its own work ends past its promise"
    assert {id(j) for j in jobs if now > j.promised} <= {id(j) for j, _, _ in late}, \
        "inputs still queued past the promise: late (their next batch would start after it)"
