"""Leader election's decisions, alone (operator/embedfleet/operator/leader.py): a held Lease is judged on
the candidate's own monotonic clock from the last change it saw, never from the holder's ``renewTime``;
a renewal's calls are bounded by the time left before the renew deadline; and the leader's deadline
always falls before the earliest moment a standby may take the Lease.
"""

from __future__ import annotations

import math

from hypothesis import example, given
from hypothesis import strategies as st

from embedfleet.operator.leader import (
    MIN_CALL_S,
    LeaseRecord,
    Observed,
    call_timeout,
    decide,
    expired,
    format_time,
    next_round_in,
    observe,
)

ME, HOLDER = "standby", "leader"


def record(holder: str = HOLDER, renew: str = "2026-01-01T00:00:00.000000Z", rv: str = "1",
           duration: int = 15) -> LeaseRecord:
    return LeaseRecord(holder=holder, renew_time=renew, duration=duration, transitions=2, resource_version=rv)


def test_a_lease_renewed_a_moment_ago_is_not_taken_whatever_its_renew_time_says() -> None:
    # The holder's clock runs 16 s behind this candidate's (or this one's 16 s ahead): its renewTime reads
    # as 16 s old, past a 15 s lease. Only the candidate's own observation counts: seen just now, live.
    stale_looking = record(renew=format_time(1_000_000.0 - 16))
    seen = observe(None, stale_looking, now=50.0)
    outcome, spec = decide(seen, ME, now=50.1, stamp=format_time(1_000_000.0), duration=15)
    assert (outcome, spec) == ("follow", None)


def test_a_record_unchanged_for_its_duration_is_taken() -> None:
    seen = observe(None, record(), now=10.0)
    assert decide(observe(seen, record(), 24.9), ME, 24.9, "t", 15)[0] == "follow"
    outcome, spec = decide(observe(seen, record(), 25.0), ME, 25.0, "t", 15)
    assert outcome == "acquire"
    assert spec == {"holderIdentity": ME, "leaseDurationSeconds": 15, "acquireTime": "t", "renewTime": "t",
                    "leaseTransitions": 3}


def test_each_renewal_restarts_the_count() -> None:
    seen = observe(None, record(rv="1"), now=0.0)
    seen = observe(seen, record(rv="2", renew="later"), now=14.0)  # renewed: counted from 14 s
    assert seen is not None and seen.at == 14.0
    assert decide(seen, ME, 28.9, "t", 15)[0] == "follow"
    assert decide(seen, ME, 29.0, "t", 15)[0] == "acquire"


def test_a_free_lease_is_taken_at_once_and_a_missing_one_created() -> None:
    free = observe(None, record(holder="", renew=""), now=0.0)
    assert decide(free, ME, 0.0, "t", 15)[0] == "acquire"
    assert observe(None, None, 0.0) is None
    assert decide(None, ME, 0.0, "t", 15) == ("create", {
        "holderIdentity": ME, "leaseDurationSeconds": 15, "acquireTime": "t", "renewTime": "t",
        "leaseTransitions": 0})


def test_our_own_lease_is_renewed() -> None:
    mine = observe(None, record(holder=ME), now=0.0)
    assert decide(mine, ME, 100.0, "t", 15) == ("renew", {"holderIdentity": ME, "leaseDurationSeconds": 15,
                                                          "renewTime": "t"})


@given(renew=st.text(max_size=40), rv=st.text(max_size=8), duration=st.integers(1, 3600),
       first=st.floats(-1e6, 1e6), later=st.floats(0, 1e4))
def test_only_the_candidates_own_clock_decides(renew: str, rv: str, duration: int, first: float,
                                               later: float) -> None:
    """Whatever the record's renewTime says, a record seen first at ``first`` is taken exactly when
    ``duration`` seconds of the candidate's clock passed without a change."""
    lease = record(renew=renew, rv=rv, duration=duration)
    seen = observe(None, lease, first)
    again = observe(seen, lease, first + later)
    assert again == seen
    assert (decide(again, ME, first + later, "t", 15)[0] == "acquire") == (first + later >= first + duration)
    assert expired(Observed(lease, first), first + later) == (first + later >= first + duration)


@given(duration=st.integers(1, 120), share=st.floats(0.01, 0.99), commit_delay=st.floats(0, 30),
       poll_lag=st.floats(0, 30), start=st.floats(0, 1e5))
def test_the_leader_stops_before_any_standby_can_take_the_lease(duration: int, share: float,
                                                                commit_delay: float, poll_lag: float,
                                                                start: float) -> None:
    """A renewal whose call starts at ``start`` is committed later and seen by a standby later still. The
    leader counts its deadline from the call's start; the standby counts the duration from when it saw
    the record. With renew deadline < lease duration, the leader's last acting moment comes first."""
    renew_deadline = duration * share  # LeaderElector refuses a deadline that is not below the duration
    leader_stops = start + renew_deadline
    seen_at = start + commit_delay + poll_lag
    seen = observe(None, record(duration=duration), seen_at)
    assert seen is not None
    # The earliest moment the standby's decision says "acquire":
    earliest = seen.at + max(seen.record.duration, 1)
    assert not expired(seen, earliest - 1e-6)
    assert leader_stops < earliest


@given(retry=st.floats(0.1, 2.9), took=st.floats(0, 30))
@example(retry=1.1968605770457807, took=0.04084941653257845)  # (retry - took) + took != retry in floats
def test_a_slow_renewal_costs_the_next_round_only_what_it_took_beyond_the_period(retry: float, took: float) -> None:
    """Rounds start every retry period from the last one's start: after a renewal that started at 0 and
    took ``took`` seconds, the next starts at max(retry, took) and keeps the rest of the renew deadline
    (which counts from 0). Counted from the end instead, it would lose ``retry`` more."""
    ended = took
    starts_at = ended + next_round_in(0.0, ended, retry)
    assert starts_at >= ended  # never before the last round ended
    assert math.isclose(starts_at, max(retry, took), abs_tol=1e-9)
    assert next_round_in(0.0, ended, retry) > 0 or took >= retry  # no wait only after a round that was the wait


@given(deadline=st.floats(-100, 100), now=st.floats(-100, 100))
def test_a_call_never_outlives_the_deadline(deadline: float, now: float) -> None:
    left = call_timeout(deadline, now)
    if deadline - now < MIN_CALL_S:
        assert left is None
    else:
        assert left is not None and now + left <= deadline + 1e-9


def test_a_leader_that_finds_its_lease_gone_has_lost_it() -> None:
    mine = observe(None, record(holder=ME), now=0.0)
    gone = observe(mine, None, now=1.0)
    assert decide(gone, ME, 1.0, "t", 15, leading=True) == ("lost", None)
    assert decide(None, ME, 1.0, "t", 15, leading=True) == ("lost", None)


def test_a_held_lease_that_went_missing_is_created_only_a_lease_duration_after_it_was_found_gone() -> None:
    seen = observe(None, record(), now=0.0)
    gone = observe(seen, None, now=3.0)
    assert gone is not None and gone.missing and gone.at == 3.0
    assert observe(gone, None, now=10.0) is gone  # still gone: the count goes on from 3 s
    assert decide(observe(gone, None, 17.9), ME, 17.9, "t", 15) == ("follow", None)
    outcome, spec = decide(observe(gone, None, 18.0), ME, 18.0, "t", 15)
    assert outcome == "create" and spec is not None and spec["holderIdentity"] == ME
    # It comes back (held by another): judged as any held Lease, counted from now.
    back = observe(gone, record(holder="other", rv="9"), now=12.0)
    assert back is not None and not back.missing and back.at == 12.0
    assert decide(back, ME, 26.9, "t", 15)[0] == "follow"


def test_a_lease_never_seen_or_last_seen_free_is_created_at_once() -> None:
    assert observe(None, None, 0.0) is None  # as client-go: NotFound on the first read creates at once
    free = observe(None, record(holder="", renew=""), now=0.0)
    assert observe(free, None, 1.0) is None
    assert decide(None, ME, 1.0, "t", 15)[0] == "create"


@given(missing_at=st.floats(0, 1e4), duration=st.integers(1, 120), later=st.floats(0, 300))
def test_a_standby_never_creates_before_the_deleted_leader_must_have_stopped(missing_at: float, duration: int,
                                                                           later: float) -> None:
    """The leader's last renewal started before the deletion, which came before the standby found the
    Lease gone; its renew deadline (< duration) ends its acting before the standby may create."""
    seen = observe(None, record(duration=duration), now=0.0)
    gone = observe(observe(seen, None, missing_at), None, missing_at + later)
    outcome = decide(gone, ME, missing_at + later, "t", 15)[0]
    assert outcome == ("create" if later >= duration else "follow")


def test_an_edit_of_labels_or_annotations_is_no_renewal() -> None:
    """Metadata edits change the resourceVersion but not the record: a dead holder's Lease is still taken
    one lease duration after its last renewal, however often someone labels it."""
    seen = observe(None, record(rv="1"), now=0.0)
    for i, now in enumerate((4.0, 8.0, 12.0), start=2):
        seen = observe(seen, record(rv=str(i)), now=now)
    assert seen is not None and seen.at == 0.0
    assert decide(seen, ME, 15.0, "t", 15)[0] == "acquire"


def test_every_field_of_the_record_marks_a_change() -> None:
    base = LeaseRecord(holder=HOLDER, renew_time="r", duration=15, transitions=1, acquire_time="a")
    for changed in (LeaseRecord(holder="x", renew_time="r", duration=15, transitions=1, acquire_time="a"),
                    LeaseRecord(holder=HOLDER, renew_time="r2", duration=15, transitions=1, acquire_time="a"),
                    LeaseRecord(holder=HOLDER, renew_time="r", duration=16, transitions=1, acquire_time="a"),
                    LeaseRecord(holder=HOLDER, renew_time="r", duration=15, transitions=2, acquire_time="a"),
                    LeaseRecord(holder=HOLDER, renew_time="r", duration=15, transitions=1, acquire_time="b")):
        seen = observe(observe(None, base, 0.0), changed, 5.0)
        assert seen is not None and seen.at == 5.0
