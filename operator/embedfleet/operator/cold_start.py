"""A runtime pod's cold start as the Pod object shows it: which phases, from which timestamps (pure).

The operator sees a pod from the outside, through the timestamps Kubernetes records on it:

* ``scheduling``: ``creationTimestamp`` -> the ``PodScheduled`` condition (the scheduler's wait: no
  node fits, or a node being added);
* ``init``: scheduled -> the ``Initialized`` condition (init containers: the ``fetch-model`` container's
  image pull and its ``embedfleet cache pull``, a node cache link or a download);
* ``image_pull``: initialized -> the last container's ``state.running.startedAt`` (the runtime image's
  pull and the container's creation and start: the runtime's process exists from its creation, so the
  runtime's own ``ready`` begins inside this phase);
* ``runtime_start``: started -> the ``Ready`` condition (inside the runtime: imports, weights read,
  engine load, warm-up; the runtime reports those parts itself, runtime/embedfleet/runtime/cold_start.py,
  and the operator adds them to its Event when it can reach the pod).

The phases partition the pod's time from creation to Ready: they are never negative and sum to
``ready - created``. Timestamps come from different clocks (API server, scheduler, kubelet), to the second;
a boundary the operator saw happen through its watch is timed by its own clock instead (`sight`,
`refined`: sub-second). Each boundary is clamped between the one before it and Ready; a boundary that is missing (no
``Initialized`` condition, a container without ``startedAt``) leaves its phase out, and that time goes to
the next phase. No cold start without both creation and Ready.

Also here: when a pod's Ready is news worth an Event (`should_report`), the Event's text
(`event_message`), and reading the runtime's own ``startup`` report (`runtime_phases`), all pure; the
handler (handlers/cold_start.py) does the I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

#: The pod-visible phases, in order; each ends at the boundary of the same index in `PodTimes.boundaries`.
POD_PHASES = ("scheduling", "init", "image_pull", "runtime_start")
#: The runtime's own phases (runtime/embedfleet/runtime/cold_start.py PHASES), in the order an Event names them.
RUNTIME_PHASES = ("weights", "weights_verify", "engine_load", "warmup", "ready", "first_request")
#: The Event's reason.
REASON = "ColdStart"


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp as Kubernetes writes it (``2026-11-27T06:01:24Z``), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@dataclass(frozen=True)
class PodTimes:
    created: datetime | None
    scheduled: datetime | None
    initialized: datetime | None
    started: datetime | None
    ready: datetime | None

    def boundaries(self) -> tuple[datetime | None, ...]:
        """The ends of `POD_PHASES`, in order."""
        return self.scheduled, self.initialized, self.started, self.ready


def _condition_time(status: Mapping[str, Any], type_: str) -> datetime | None:
    for cond in status.get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == type_ and cond.get("status") == "True":
            return parse_time(cond.get("lastTransitionTime"))
    return None


def pod_times(pod: Mapping[str, Any]) -> PodTimes:
    """The timestamps of `POD_PHASES` from a Pod object (missing ones None)."""
    status = pod.get("status") or {}
    starts = [parse_time(((c.get("state") or {}).get("running") or {}).get("startedAt"))
              for c in status.get("containerStatuses") or [] if isinstance(c, Mapping)]
    started = max(starts) if starts and all(s is not None for s in starts) else None  # type: ignore[type-var]
    return PodTimes(created=parse_time((pod.get("metadata") or {}).get("creationTimestamp")),
                    scheduled=_condition_time(status, "PodScheduled"),
                    initialized=_condition_time(status, "Initialized"),
                    started=started, ready=_condition_time(status, "Ready"))


#: A pod's boundaries by name, in the order of ``PodTimes``' fields.
BOUNDARIES = ("created", "scheduled", "initialized", "started", "ready")


@dataclass(frozen=True)
class Seen:
    """When this operator saw each boundary of one pod happen, by its own clock (microseconds, where the Pod's
    timestamps are whole seconds from several clocks). ``at``: boundary -> the first sight of the pod with it
    passed; ``passed``: the boundaries already passed at the first sight of the pod (their time is unknown
    here: the Pod's own timestamp stands)."""

    at: Mapping[str, datetime]
    passed: frozenset[str]


def _passed(times: PodTimes) -> set[str]:
    return {name for name in BOUNDARIES if getattr(times, name) is not None}


def sight(seen: Seen | None, times: PodTimes, now: datetime) -> Seen:
    """`seen` updated with one sight of the pod (`times`, read from it) at `now`. Creation is stamped only at a
    first sight with nothing else passed yet (the pod's ADDED event: it was created a moment ago); a boundary
    is stamped at the first sight that shows it passed, if it was not passed at the first sight."""
    passed = _passed(times)
    if seen is None:
        if passed <= {"created"}:
            return Seen({"created": now}, frozenset())
        return Seen({}, frozenset(passed))
    new = {name: now for name in passed - seen.passed - set(seen.at)}
    return Seen({**seen.at, **new}, seen.passed) if new else seen


def refined(times: PodTimes, seen: Seen | None) -> PodTimes:
    """`times` with each boundary this operator saw happen at the time it saw it (sub-second); the rest as the
    Pod says. Phases from it still partition creation -> Ready (`pod_phases` clamps any mix of clocks)."""
    if seen is None:
        return times
    return PodTimes(**{name: seen.at.get(name, getattr(times, name)) for name in BOUNDARIES})


def pod_phases(times: PodTimes) -> dict[str, float] | None:
    """Seconds per pod-visible phase (see the module docstring), or None before Ready or without creation."""
    if times.created is None or times.ready is None:
        return None
    ready = max(times.ready, times.created)
    out: dict[str, float] = {}
    previous = times.created
    for phase, end in zip(POD_PHASES, times.boundaries(), strict=True):
        if end is None:
            continue  # its time goes to the next phase whose end is known (Ready, at the latest)
        end = min(max(end, previous), ready)
        out[phase] = (end - previous).total_seconds()
        previous = end
    return out


def is_ready(pod: Mapping[str, Any]) -> bool:
    return _condition_time(pod.get("status") or {}, "Ready") is not None


def should_report(ready_at: datetime | None, reported: bool, watching_since: datetime) -> bool:
    """Whether this sight of a pod is its first Ready that this operator should report.

    Once per pod (``reported``: this process already did), and only for a Ready that happened while this
    process watched (to the second, Kubernetes' resolution): a pod found Ready when the watch starts
    became Ready before, and a previous leader may have reported it."""
    if reported or ready_at is None:
        return False
    return ready_at >= watching_since.replace(microsecond=0)


def runtime_phases(report: Any) -> dict[str, float]:
    """The runtime's phases from its ``GET /load`` ``startup`` section; anything malformed is left out
    (the runtime may be of another version, or not ours)."""
    phases = report.get("phases") if isinstance(report, Mapping) else None
    if not isinstance(phases, Mapping):
        return {}
    return {name: float(value) for name, value in phases.items()
            if name in RUNTIME_PHASES and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0}


def weights_source(report: Any) -> str | None:
    source = report.get("weights_source") if isinstance(report, Mapping) else None
    return source if isinstance(source, str) and source and len(source) <= 64 else None


ENGINE_SOURCES = ("built", "cache", "peer")


def engine_source(report: Any) -> str | None:
    """Where the runtime's engine builds came from (``built``, ``cache``: this node, ``peer``), from the
    ``engine`` entries of the report's models; None for engines that build nothing or a report without them."""
    models = report.get("models") if isinstance(report, Mapping) else None
    if not isinstance(models, Mapping):
        return None
    found = sorted({m["engine"]["source"] for m in models.values()
                    if isinstance(m, Mapping) and isinstance(m.get("engine"), Mapping)
                    and m["engine"].get("source") in ENGINE_SOURCES})
    return ",".join(found) or None


def _seconds(value: float) -> str:
    return f"{value:.0f}s" if value >= 10 or value == int(value) else f"{value:.1f}s"


def event_message(pod: str, phases: Mapping[str, float], runtime: Mapping[str, float] | None = None,
                  source: str | None = None, engine: str | None = None) -> str:
    """``pod web-x Ready 14s after creation: scheduling 1s, init 6s, image_pull 2s, runtime_start 5s;
    runtime: weights 5.8s (peer), engine_load 2.1s (build: peer), warmup 0.9s, ready 3.9s`` (the runtime
    part only when the operator read it; the build's source only for engines that build one)."""
    total = sum(phases.values())
    parts = ", ".join(f"{p} {_seconds(phases[p])}" for p in POD_PHASES if p in phases)
    text = f"pod {pod} Ready {_seconds(total)} after creation: {parts}"
    inner = []
    for phase in RUNTIME_PHASES:
        if runtime and phase in runtime:
            note = f" ({source})" if phase == "weights" and source else ""
            note = f" (build: {engine})" if phase == "engine_load" and engine else note
            inner.append(f"{phase} {_seconds(runtime[phase])}{note}")
    if source and runtime is not None and "weights" not in runtime:
        inner.insert(0, f"weights from {source}")
    if inner:
        text += "; runtime: " + ", ".join(inner)
    elif runtime is None:
        text += "; runtime phases not read (the pod did not answer GET /load)"
    return text
