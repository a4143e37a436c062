"""Scheduled floors: which ``spec.autoscaling.schedule`` windows are open at an instant, and the floor they
raise. Pure: the caller passes the time (UTC) and gets the floor, the open entries' names and when that
answer next changes.

Semantics (docs/autoscaling.md, "Scheduled floors"):

- An entry is open from its most recent ``start`` occurrence at or before ``now`` until the first ``end``
  occurrence strictly after that start. A start that comes while the window is open changes nothing (the
  same end closes it); an end that falls on the same instant as a start does not close the window that
  start opens (it runs to the following end). An entry whose start and end are the same expression would
  never close, so admission refuses it.
- The floor is the highest ``minReplicas`` of the open entries, 0 when none is open.
- Cron expressions have five fields and are read as wall-clock times in the entry's IANA time zone, as
  cron reads them: a time the clocks skip (spring forward) happens at the first instant after the gap; a
  time the clocks pass twice (fall back) happens once, the first time. That mapping from wall-clock to
  UTC never runs backwards, so "most recent" and "first after" are well defined across transitions.

The cron grammar is cronsim's (the one healthchecks.io runs: ranges, steps, names, ``L``, ``#``), always
iterated on naive wall-clock times; the time-zone mapping is done here, with stdlib ``zoneinfo`` (the
``tzdata`` package supplies the database where the image has none).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import NamedTuple, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

#: cronsim gives up after 50 years without a match; so do we (an expression that never matches).
_NEVER = "never occurs"


class Entry(Protocol):
    """What the floor needs of a schedule entry (crd/schedule.py's ScheduleEntry has it)."""

    @property
    def name(self) -> str: ...
    @property
    def start(self) -> str: ...
    @property
    def end(self) -> str: ...
    @property
    def timezone(self) -> str: ...
    @property
    def min_replicas(self) -> int: ...


class ScheduledFloor(NamedTuple):
    """The floor at an instant: ``floor`` (0 when no window is open), the open entries' names (the ones
    whose minReplicas is the floor first), and ``next_change``: the first instant after ``now`` at which an
    entry opens or closes (None when none ever will). The floor and the open set are constant until then."""

    floor: int
    active: tuple[str, ...]
    next_change: datetime | None

    def describe(self) -> str:
        """For decision reasons and Events: ``schedule peak`` / ``schedules peak, batch``."""
        word = "schedule" if len(self.active) == 1 else "schedules"
        return f"{word} {', '.join(self.active)}"


@dataclass(frozen=True)
class Window:
    """One entry's state at an instant: open since ``opened`` until ``closes``, or closed until ``opens``."""

    name: str
    min_replicas: int
    open: bool
    opened: datetime | None
    change: datetime | None


def _wall_to_utc(wall: datetime, zone: tzinfo) -> datetime:
    """A naive wall-clock time in ``zone`` as an aware UTC instant, as cron reads it: the first of two
    (fold=0), and for a time the clocks skipped, the first real minute after it. Non-decreasing in ``wall``."""
    aware = wall.replace(tzinfo=zone, fold=0)
    utc = aware.astimezone(UTC)
    step = wall
    while utc.astimezone(zone).replace(tzinfo=None) != step:  # skipped: walk out of the gap
        step += timedelta(minutes=1)
        utc = step.replace(tzinfo=zone, fold=0).astimezone(UTC)
    return utc


def _wall(instant: datetime, zone: tzinfo) -> datetime:
    return instant.astimezone(zone).replace(tzinfo=None, microsecond=0)


def _occurrences(expr: str, zone: tzinfo, wall_from: datetime, reverse: bool) -> Iterator[datetime]:
    """UTC instants of ``expr`` from the wall-clock time ``wall_from`` (exclusive) onwards or backwards."""
    try:
        for wall in CronSim(expr, wall_from, reverse=reverse):
            yield _wall_to_utc(wall, zone)
    except StopIteration:  # cronsim: no match within 50 years
        return


def last_at_or_before(expr: str, zone: tzinfo, instant: datetime) -> datetime | None:
    """The newest occurrence at or before ``instant`` (UTC)."""
    for utc in _occurrences(expr, zone, _wall_after(instant, zone), reverse=True):
        if utc <= instant:
            return utc
    return None


def first_after(expr: str, zone: tzinfo, instant: datetime) -> datetime | None:
    """The oldest occurrence strictly after ``instant`` (UTC). Wall-clock times before ``instant``'s own
    map at or before it (the mapping never runs backwards), so iterating from there misses nothing."""
    for utc in _occurrences(expr, zone, _wall(instant, zone), reverse=False):
        if utc > instant:
            return utc
    return None


def _wall_after(instant: datetime, zone: tzinfo) -> datetime:
    """A wall-clock time in ``zone`` that maps after ``instant``, so every later one does too: an hour on
    is enough but where a zone jumped further (Samoa skipped a whole day in 2011)."""
    step = timedelta(hours=1)
    while _wall_to_utc(_wall(instant, zone) + step, zone) <= instant:
        step *= 2
    return _wall(instant, zone) + step


def window(entry: Entry, now: datetime) -> Window:
    """Whether ``entry`` is open at ``now`` (aware), and when that next changes."""
    zone = ZoneInfo(entry.timezone)
    opened = last_at_or_before(entry.start, zone, now)
    closes = first_after(entry.end, zone, opened) if opened is not None else None
    if opened is not None and (closes is None or now < closes):  # no end ever: open for good once started
        return Window(entry.name, entry.min_replicas, True, opened, closes)
    return Window(entry.name, entry.min_replicas, False, None, first_after(entry.start, zone, now))


def scheduled_floor(entries: Iterable[Entry], now: datetime) -> ScheduledFloor:
    """The floor the schedule raises at ``now`` (an aware datetime; naive is refused rather than guessed)."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (UTC)")
    now = now.astimezone(UTC)
    windows = [window(e, now) for e in entries]
    open_ = sorted((w for w in windows if w.open), key=lambda w: -w.min_replicas)
    changes = [w.change for w in windows if w.change is not None]
    return ScheduledFloor(
        floor=max((w.min_replicas for w in open_), default=0),
        active=tuple(w.name for w in open_),
        next_change=min(changes, default=None),
    )


def entry_problems(entries: Sequence[Entry], max_replicas: int, where: str = "spec.autoscaling.schedule"
                   ) -> list[str]:
    """Each problem as one sentence naming the entry: a cron expression that does not parse or never
    occurs, an unknown time zone, start equal to end, a floor above maxReplicas, a repeated name."""
    problems: list[str] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        label = f"{where}[{i}] ({entry.name})"
        if entry.name in seen:
            problems.append(f"{label}: the name {entry.name!r} is used by an earlier entry")
        seen.add(entry.name)
        try:
            ZoneInfo(entry.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            problems.append(f"{label}: timezone {entry.timezone!r} is not an IANA time zone (e.g. Europe/Berlin)")
        for field, expr in (("start", entry.start), ("end", entry.end)):
            problem = cron_problem(expr)
            if problem is not None:
                problems.append(f"{label}: {field} {expr!r} {problem}")
        if " ".join(entry.start.split()) == " ".join(entry.end.split()):
            problems.append(f"{label}: start and end are the same expression {entry.start!r}: the window would"
                            " never close")
        if entry.min_replicas > max_replicas:
            problems.append(f"{label}: minReplicas ({entry.min_replicas}) is greater than maxReplicas"
                            f" ({max_replicas})")
    return problems


def cron_problem(expr: str) -> str | None:
    """Why ``expr`` is not a usable five-field cron expression; None when it is."""
    fields = expr.split()
    if len(fields) != 5:
        return f"has {len(fields)} fields, not 5 (minute hour day-of-month month day-of-week)"
    try:
        next(CronSim(expr, datetime(2000, 1, 1)))
    except CronSimError as exc:
        return f"is not a cron expression: {str(exc).lower() or 'bad syntax'}"
    except StopIteration:
        return _NEVER
    return None
