"""Scheduled floors as a pure function: which windows are open, the floor they raise, when that changes.

Properties over generated cron entries, time zones with daylight-saving (and stranger) transitions and
instants near those transitions; then the cases a reader checks by hand."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.operator.autoscale_schedule import (
    cron_problem,
    entry_problems,
    first_after,
    last_at_or_before,
    scheduled_floor,
)


@dataclass(frozen=True)
class Entry:
    name: str
    start: str
    end: str
    timezone: str = "UTC"
    min_replicas: int = 1


ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Pacific/Apia", "Asia/Kolkata",
         "America/Santiago"]
#: Instants the clocks jump at (UTC), so generated instants crowd around them.
TRANSITIONS = [
    datetime(2026, 3, 8, 7, 0, tzinfo=UTC),    # New York springs forward 02:00 -> 03:00
    datetime(2026, 11, 1, 6, 0, tzinfo=UTC),   # New York falls back 02:00 -> 01:00
    datetime(2026, 3, 29, 1, 0, tzinfo=UTC),   # Berlin springs forward
    datetime(2026, 10, 25, 1, 0, tzinfo=UTC),  # Berlin falls back
    datetime(2026, 4, 4, 15, 0, tzinfo=UTC),   # Lord Howe falls back half an hour
    datetime(2011, 12, 30, 10, 0, tzinfo=UTC),  # Samoa skips 30 December 2011
]

minutes = st.sampled_from(["0", "15", "30", "45", "*/20", "5,35", "*"])
hours = st.sampled_from(["*", "0", "1", "2", "3", "9", "17", "23", "1-3", "*/6", "2,14"])
days = st.sampled_from(["*", "*", "*", "1", "15", "L", "1-7"])
weekdays = st.sampled_from(["*", "*", "1-5", "0", "6", "MON", "5#1"])
crons = st.builds(lambda m, h, d, w: f"{m} {h} {d} * {w}", minutes, hours, days, weekdays)


@st.composite
def entries(draw: st.DrawFn) -> list[Entry]:
    count = draw(st.integers(1, 4))
    out = []
    for i in range(count):
        start, end = draw(crons), draw(crons)
        if start == end:
            end = "59 23 * * *" if start != "59 23 * * *" else "0 0 * * *"
        out.append(Entry(f"e{i}", start, end, draw(st.sampled_from(ZONES)), draw(st.integers(0, 12))))
    return out


instants = st.one_of(
    st.datetimes(datetime(2024, 1, 1), datetime(2028, 1, 1), timezones=st.just(UTC)),
    st.builds(lambda t, m, s: t + timedelta(minutes=m, seconds=s),
              st.sampled_from(TRANSITIONS), st.integers(-26 * 60, 26 * 60), st.integers(0, 59)),
)


@settings(max_examples=150, deadline=None)
@given(entries(), instants)
def test_the_floor_is_an_open_entrys_min_replicas_or_zero(schedule: list[Entry], now: datetime) -> None:
    result = scheduled_floor(schedule, now)
    by_name = {e.name: e for e in schedule}
    assert set(result.active) <= set(by_name)
    if result.active:
        assert result.floor == max(by_name[n].min_replicas for n in result.active)
        assert by_name[result.active[0]].min_replicas == result.floor
    else:
        assert result.floor == 0


@settings(max_examples=120, deadline=None)
@given(entries(), instants, st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=4))
def test_nothing_changes_before_the_next_change_and_it_is_in_the_future(
        schedule: list[Entry], now: datetime, fractions: list[float]) -> None:
    result = scheduled_floor(schedule, now)
    if result.next_change is None:
        return
    assert result.next_change > now
    span = result.next_change - now
    last = result.next_change - timedelta(microseconds=1)
    for t in [min(now + span * f, last) for f in fractions] + [last]:  # (span * f rounds to microseconds)
        later = scheduled_floor(schedule, t)
        assert (later.floor, set(later.active)) == (result.floor, set(result.active)), t


@settings(max_examples=150, deadline=None)
@given(crons, st.sampled_from(ZONES), instants)
def test_occurrences_bracket_the_instant(expr: str, zone_name: str, now: datetime) -> None:
    """The newest occurrence at or before an instant and the oldest after it: nothing lies between them,
    and both are real instants of the cron expression's wall-clock times (or the first after a gap)."""
    zone = ZoneInfo(zone_name)
    before, after = last_at_or_before(expr, zone, now), first_after(expr, zone, now)
    assert before is not None and after is not None
    assert before <= now < after
    assert first_after(expr, zone, before) == after
    assert last_at_or_before(expr, zone, after - timedelta(microseconds=1)) == before


# ------------------------------------------------------------------------------------ cases by hand

WEEKDAY_PEAK = Entry("peak", "0 8 * * 1-5", "0 18 * * 1-5", "Europe/Berlin", 3)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def test_a_weekday_window_opens_and_closes_in_its_time_zone() -> None:
    assert scheduled_floor([WEEKDAY_PEAK], at("2026-03-09T07:59:59+01:00")) == (0, (), at("2026-03-09T08:00+01:00"))
    assert scheduled_floor([WEEKDAY_PEAK], at("2026-03-09T08:00+01:00")) == (3, ("peak",), at("2026-03-09T18:00+01:00"))
    # Friday evening until Monday morning: closed.
    assert scheduled_floor([WEEKDAY_PEAK], at("2026-03-14T12:00+01:00")).next_change == at("2026-03-16T08:00+01:00")
    # Summer time: the same wall-clock hours, an hour earlier in UTC.
    assert scheduled_floor([WEEKDAY_PEAK], at("2026-06-01T06:30Z")).floor == 3
    assert scheduled_floor([WEEKDAY_PEAK], at("2026-06-01T16:00Z")).floor == 0


def test_overlapping_windows_take_the_highest_floor() -> None:
    lunch = Entry("lunch", "0 11 * * *", "0 14 * * *", "Europe/Berlin", 5)
    result = scheduled_floor([WEEKDAY_PEAK, lunch], at("2026-03-09T12:00+01:00"))
    assert result.floor == 5 and result.active == ("lunch", "peak")
    assert result.next_change == at("2026-03-09T14:00+01:00")
    assert result.describe() == "schedules lunch, peak"


def test_a_window_across_midnight_and_a_start_inside_an_open_window() -> None:
    night = Entry("night", "0 22 * * *", "0 2 * * *", min_replicas=2)
    assert scheduled_floor([night], at("2026-01-01T01:00Z")).floor == 2
    assert scheduled_floor([night], at("2026-01-01T03:00Z")).floor == 0
    # Hourly starts inside a daily window: each start is closed by the same end.
    hourly = Entry("hourly", "0 * * * *", "30 17 * * *")
    assert scheduled_floor([hourly], at("2026-01-01T12:10Z")).next_change == at("2026-01-01T17:30Z")
    assert scheduled_floor([hourly], at("2026-01-01T17:40Z")).next_change == at("2026-01-01T18:00Z")


def test_an_end_at_the_same_instant_as_a_start_does_not_close_that_window() -> None:
    """Daily start at 09:00, end Mondays at 09:00: Monday's start opens a window Monday's end cannot close
    (an end counts only strictly after the start), so it lasts the week."""
    week = Entry("week", "0 9 * * *", "0 9 * * 1")
    monday = at("2026-03-09T09:00Z")
    assert scheduled_floor([week], monday) == (1, ("week",), at("2026-03-16T09:00Z"))
    assert scheduled_floor([week], monday - timedelta(seconds=1)).floor == 1  # Sunday's start opened it


def test_daylight_saving_transitions_as_cron_reads_them() -> None:
    """New York, 2026: 02:30 does not exist on 8 March (it happens at 03:00 EDT); 01:30 happens twice on
    1 November (the window opens the first time and the second pass changes nothing)."""
    skipped = Entry("skipped", "30 2 * * *", "0 4 * * *", "America/New_York")
    result = scheduled_floor([skipped], at("2026-03-08T01:59-05:00"))
    assert result.floor == 0 and result.next_change == at("2026-03-08T03:00-04:00")
    assert scheduled_floor([skipped], at("2026-03-08T03:00-04:00")).floor == 1

    twice = Entry("twice", "30 1 * * *", "45 1 * * *", "America/New_York")
    assert scheduled_floor([twice], at("2026-11-01T01:30-04:00")).next_change == at("2026-11-01T01:45-04:00")
    second_pass = scheduled_floor([twice], at("2026-11-01T01:30-05:00"))
    assert second_pass.floor == 0 and second_pass.next_change == at("2026-11-02T01:30-05:00")


def test_naive_instants_are_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        scheduled_floor([WEEKDAY_PEAK], datetime(2026, 1, 1))


def test_no_entries_no_floor() -> None:
    assert scheduled_floor([], at("2026-01-01T00:00Z")) == (0, (), None)


@pytest.mark.parametrize(("expr", "problem"), [
    ("0 8 * *", "has 4 fields, not 5"),
    ("0 8 * * * *", "has 6 fields, not 5"),
    ("61 8 * * *", "bad minute"),
    ("0 25 * * *", "bad hour"),
    ("0 0 30 2 *", "bad day-of-month"),
    ("0 8 * * MONDAY", "bad day-of-week"),
])
def test_cron_problems_say_what_is_wrong(expr: str, problem: str) -> None:
    assert problem in (cron_problem(expr) or "")


def test_entry_problems_name_the_entry() -> None:
    bad = [Entry("ok", "0 8 * * 1-5", "0 18 * * 1-5", "Europe/Berlin", 3),
           Entry("mars", "0 8 * * *", "0 9 * * *", "Mars/Olympus_Mons", 2),
           Entry("same", "0 8 * * *", "0  8 * * *"),
           Entry("big", "0 8 * * *", "0 9 * * *", min_replicas=11),
           Entry("ok", "0 7 * * *", "0 9 * * *")]
    problems = entry_problems(bad, max_replicas=10)
    assert problems == [
        "spec.autoscaling.schedule[1] (mars): timezone 'Mars/Olympus_Mons' is not an IANA time zone"
        " (e.g. Europe/Berlin)",
        "spec.autoscaling.schedule[2] (same): start and end are the same expression '0 8 * * *': the window"
        " would never close",
        "spec.autoscaling.schedule[3] (big): minReplicas (11) is greater than maxReplicas (10)",
        "spec.autoscaling.schedule[4] (ok): the name 'ok' is used by an earlier entry",
    ]
    assert entry_problems(bad[:1], max_replicas=10) == []
