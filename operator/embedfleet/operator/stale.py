"""How a pod that did not answer this tick still counts towards the autoscaler's in-flight total.

Under overload the pods most likely to miss a scrape are the busiest ones. Dropping them from the sum
would read overload as a lighter load, and treating the whole total as unknown (what the autoscaler
did before) freezes the fleet's size exactly when it must grow. So each Ready pod is counted every
tick, from the best evidence there is:

* answered this tick: its own gauge;
* failed, last success younger than ``hold_s``: max(last known in-flight, target per replica) — at
  least as loaded as when last seen, and never less than a full replica's worth;
* failed, no success within ``hold_s`` (or never): the target per replica. That asks for exactly the
  replica the pod already is, so a pod with a broken /metrics neither grows nor shrinks the fleet —
  and it is never 0, which would read as idle capacity and shrink it.

Pods no longer listed (deleted, or not Ready any more) are forgotten: their memory goes with them.
When no listed pod answered at all there is no fresh evidence, and the total is None (unknown): the
caller keeps the size rather than scale on memory alone, which during a network partition between the
operator and its pods could otherwise walk the fleet up to maxReplicas.

Pure: the caller passes ``now`` (any monotonic clock) and keeps the returned memory for the next tick.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from embedfleet.operator.signals import PodReading

Basis = Literal["answered", "last-known", "target"]


@dataclass(frozen=True)
class LastSeen:
    """A pod's last successful reading and when (the caller's clock) it was taken."""

    in_flight: float
    at: float


@dataclass(frozen=True)
class PodLoad:
    """What one pod contributes to this tick's total, and on what evidence."""

    pod: str
    counted: float
    basis: Basis
    error: str | None = None
    last_seen: LastSeen | None = None

    def describe(self, now: float) -> str:
        if self.basis == "answered":
            return f"{self.pod}: {self.counted:g}"
        if self.last_seen is None:
            seen = "never answered"
        else:
            seen = f"last answered {max(now - self.last_seen.at, 0.0):.0f}s ago with {self.last_seen.in_flight:g}"
        return f"{self.pod} unreachable, counted as {self.counted:g} ({self.basis}; {seen})"


@dataclass(frozen=True)
class FleetLoad:
    """This tick's total over the listed pods, each pod's share, and the memory for the next tick."""

    in_flight: float | None
    pods: tuple[PodLoad, ...]
    memory: Mapping[str, LastSeen]
    async_depth: float | None = None

    @property
    def answered(self) -> int:
        return sum(1 for p in self.pods if p.basis == "answered")

    @property
    def estimated(self) -> tuple[PodLoad, ...]:
        """The pods counted from memory or the target rather than from an answer this tick."""
        return tuple(p for p in self.pods if p.basis != "answered")


def count_pods(
    readings: Sequence[PodReading],
    memory: Mapping[str, LastSeen],
    now: float,
    target: float,
    hold_s: float,
) -> FleetLoad:
    """Merge this tick's per-pod readings with what earlier ticks saw; see the module docstring.

    ``readings`` holds one entry per pod listed Ready now (signals.scrape returns exactly that);
    ``target`` is the per-replica target in in-flight requests; ``hold_s`` how long a last known value
    outranks the target.
    """
    if target <= 0:
        raise ValueError("target must be > 0")
    loads: list[PodLoad] = []
    kept: dict[str, LastSeen] = {}
    for reading in readings:
        if reading.in_flight is not None:
            seen = LastSeen(max(reading.in_flight, 0.0), now)
            kept[reading.pod] = seen
            loads.append(PodLoad(reading.pod, seen.in_flight, "answered", last_seen=seen))
            continue
        last = memory.get(reading.pod)
        if last is not None:
            kept[reading.pod] = last  # the hold clock runs from the last success, not from this failure
        if last is not None and now - last.at < hold_s:
            loads.append(PodLoad(reading.pod, max(last.in_flight, target), "last-known", reading.error, last))
        else:
            loads.append(PodLoad(reading.pod, target, "target", reading.error, last))
    answered = [p for p in loads if p.basis == "answered"]
    depths = [r.async_depth for r in readings if r.in_flight is not None and r.async_depth is not None]
    total = None if readings and not answered else float(sum(p.counted for p in loads))
    return FleetLoad(in_flight=total, pods=tuple(loads), memory=kept, async_depth=max(depths, default=None))


def due_warnings(
    fleet: FleetLoad, warned_at: Mapping[str, float], now: float, every_s: float
) -> tuple[tuple[PodLoad, ...], dict[str, float]]:
    """The estimated pods to name in a Warning now, and the updated per-pod "last warned" times.

    A pod that stays unreachable is news once per ``every_s``, not once per tick; pods no longer listed
    are forgotten, so a replacement with the same name is news again.
    """
    listed = {p.pod for p in fleet.pods}
    kept = {pod: at for pod, at in warned_at.items() if pod in listed}
    due = tuple(p for p in fleet.estimated if now - kept.get(p.pod, float("-inf")) >= every_s)
    for p in due:
        kept[p.pod] = now
    return due, kept
