"""Which cold-start phases a Pod shows, from which timestamps (operator/cold_start.py): examples read from
Pod objects as the API server writes them, and properties over any timestamps, in any order, any missing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.cold_start import (
    POD_PHASES,
    PodTimes,
    engine_source,
    event_message,
    pod_phases,
    pod_times,
    refined,
    runtime_phases,
    should_report,
    sight,
    weights_source,
)

T0 = datetime(2026, 11, 27, 6, 0, 0, tzinfo=UTC)


def stamp(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(scheduled: float | None = 2, initialized: float | None = 9, started: list[float | None] | None = None,
        ready: float | None = 20, created: float | None = 0) -> dict:
    conditions = [{"type": t, "status": "True", "lastTransitionTime": stamp(s)}
                  for t, s in (("PodScheduled", scheduled), ("Initialized", initialized), ("Ready", ready))
                  if s is not None]
    containers = [{"name": f"c{i}", "state": {"running": {"startedAt": stamp(s)}} if s is not None else
                   {"waiting": {"reason": "ContainerCreating"}}} for i, s in enumerate(started or [12])]
    meta = {"name": "web-1", "uid": "u1"}
    if created is not None:
        meta["creationTimestamp"] = stamp(created)
    return {"metadata": meta, "status": {"conditions": conditions, "containerStatuses": containers}}


def test_a_ready_pod_splits_into_the_four_phases() -> None:
    assert pod_phases(pod_times(pod())) == {"scheduling": 2, "init": 7, "image_pull": 3, "runtime_start": 8}


def test_the_last_container_to_start_ends_the_image_pull() -> None:
    assert pod_phases(pod_times(pod(started=[11, 14])))["image_pull"] == 5


def test_before_ready_or_without_creation_there_is_no_cold_start() -> None:
    assert pod_phases(pod_times(pod(ready=None))) is None
    assert pod_phases(pod_times(pod(created=None))) is None


def test_a_missing_boundary_gives_its_time_to_the_next_phase() -> None:
    assert pod_phases(pod_times(pod(initialized=None))) == {"scheduling": 2, "image_pull": 10, "runtime_start": 8}
    # a container not running (no startedAt): the started boundary is unknown
    assert pod_phases(pod_times(pod(started=[12, None]))) == {"scheduling": 2, "init": 7, "runtime_start": 11}


def test_clocks_out_of_order_are_clamped() -> None:
    # the kubelet's clock says the container started before the scheduler placed the pod, and after Ready
    assert pod_phases(pod_times(pod(scheduled=5, initialized=3, started=[25]))) == \
        {"scheduling": 5, "init": 0, "image_pull": 15, "runtime_start": 0}
    # Ready stamped before creation: nothing to split
    assert set(pod_phases(pod_times(pod(scheduled=None, initialized=None, started=[None], ready=-3))).values()) \
        == {0}


def test_unparsable_timestamps_count_as_missing() -> None:
    body = pod()
    body["status"]["conditions"][0]["lastTransitionTime"] = "yesterday"
    assert "scheduling" not in pod_phases(pod_times(body))


moments = st.one_of(st.none(), st.integers(-3600, 7200).map(lambda s: T0 + timedelta(seconds=s)))


@given(created=moments, scheduled=moments, initialized=moments, started=moments, ready=moments)
def test_phases_are_never_negative_and_sum_to_ready_minus_created(created, scheduled, initialized, started,
                                                                  ready) -> None:
    phases = pod_phases(PodTimes(created, scheduled, initialized, started, ready))
    if created is None or ready is None:
        assert phases is None
        return
    assert phases is not None
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == max(0.0, (ready - created).total_seconds())
    assert list(phases) == [p for p in POD_PHASES if p in phases]  # in order, only known names
    assert "runtime_start" in phases  # Ready is always a known end
    known = {"scheduling": scheduled, "init": initialized, "image_pull": started}
    assert {p for p, t in known.items() if t is not None} <= set(phases)


def test_a_ready_pod_is_reported_once_and_only_when_it_turned_ready_while_watched() -> None:
    since = T0 + timedelta(seconds=10.7)
    assert should_report(T0 + timedelta(seconds=10), reported=False, watching_since=since)  # same second
    assert not should_report(T0 + timedelta(seconds=10), reported=True, watching_since=since)
    assert not should_report(T0 + timedelta(seconds=9), reported=False, watching_since=since)
    assert not should_report(None, reported=False, watching_since=since)


def test_the_runtime_report_is_read_tolerantly() -> None:
    report = {"phases": {"weights": 5.8, "engine_load": 2, "warmup": -1, "ready": "x", "first_request": float("nan"),
                         "later": 3, "weights_verify": True}, "weights_source": "peer"}
    assert runtime_phases(report) == {"weights": 5.8, "engine_load": 2.0}
    assert weights_source(report) == "peer"
    for junk in (None, [], "text", {"phases": [1, 2]}, {"phases": None}):
        assert runtime_phases(junk) == {}
        assert weights_source(junk) is None


def test_the_event_names_the_pod_and_every_phase() -> None:
    phases = {"scheduling": 1.0, "init": 6.0, "image_pull": 2.0, "runtime_start": 5.0}
    text = event_message("web-1", phases, {"weights": 5.8, "engine_load": 2.1, "ready": 3.9}, "peer")
    assert text == ("pod web-1 Ready 14s after creation: scheduling 1s, init 6s, image_pull 2s, runtime_start 5s; "
                    "runtime: weights 5.8s (peer), engine_load 2.1s, ready 3.9s")
    unread = event_message("web-1", phases, None)
    assert unread.endswith("runtime phases not read (the pod did not answer GET /load)")
    assert "weights from downloaded" in event_message("web-1", phases, {"engine_load": 1.0}, "downloaded")


def test_the_engine_builds_source_is_read_and_said_beside_engine_load() -> None:
    report = {"models": {"a": {"engine": {"source": "peer", "path": "/x", "from": "http://10.0.0.1:8476"}},
                         "b": {"engine": {"source": "built", "path": "/y"}}, "c": {"weights": None}}}
    assert engine_source(report) == "built,peer"
    assert engine_source({"models": {"a": {"engine_load": 1.0}}}) is None
    for junk in (None, [], {"models": []}, {"models": {"a": {"engine": {"source": "x" * 100}}}},
                 {"models": {"a": {"engine": "peer"}}}):
        assert engine_source(junk) is None
    phases = {"scheduling": 1.0, "runtime_start": 5.0}
    text = event_message("web-1", phases, {"engine_load": 2.1, "ready": 3.9}, "cache", "peer")
    assert "engine_load 2.1s (build: peer)" in text
    assert "(build:" not in event_message("web-1", phases, {"engine_load": 2.1}, "cache")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_boundaries_seen_happening_are_timed_by_the_watch_to_the_sub_second() -> None:
    """The pod's ADDED event, then events showing it scheduled, initialized, started, Ready: each boundary is
    the arrival of the first event that shows it; the Pod's whole seconds give way."""
    seen = sight(None, pod_times(pod(scheduled=None, initialized=None, started=[None], ready=None)), at(0.2))
    seen = sight(seen, pod_times(pod(initialized=None, started=[None], ready=None)), at(0.45))
    seen = sight(seen, pod_times(pod(started=[None], ready=None)), at(1.3))
    seen = sight(seen, pod_times(pod(started=[12], ready=None)), at(3.05))
    seen = sight(seen, pod_times(pod(started=[12], ready=None)), at(3.5))  # nothing new: nothing moves
    times = pod_times(pod(started=[12]))
    seen = sight(seen, times, at(5.25))
    phases = pod_phases(refined(times, seen))
    assert phases == {"scheduling": 0.25, "init": 0.85, "image_pull": 1.75, "runtime_start": 2.2}


def test_a_pod_first_seen_already_under_way_keeps_its_own_timestamps_for_what_had_passed() -> None:
    # first seen scheduled (the operator started after the pod): creation and scheduling as the Pod says
    seen = sight(None, pod_times(pod(initialized=None, started=[None], ready=None)), at(4.4))
    times = pod_times(pod())
    seen = sight(seen, times, at(20.6))  # initialized, started and Ready all in one event
    assert refined(times, seen) == PodTimes(T0, at(2), at(20.6), at(20.6), at(20.6))
    assert pod_phases(refined(times, seen)) == {"scheduling": 2, "init": 18.6, "image_pull": 0, "runtime_start": 0}
    assert refined(times, None) == times


@given(created=moments, scheduled=moments, initialized=moments, started=moments, ready=moments,
       arrivals=st.lists(st.floats(0, 7200), min_size=1, max_size=6))
def test_refined_phases_still_partition_creation_to_ready(created, scheduled, initialized, started, ready,
                                                          arrivals) -> None:
    times = PodTimes(created, scheduled, initialized, started, ready)
    seen = None
    for when in sorted(arrivals):
        seen = sight(seen, times, at(when))
    better = refined(times, seen)
    phases = pod_phases(better)
    if better.created is None or better.ready is None:
        assert phases is None
        return
    assert phases is not None and all(v >= 0 for v in phases.values())
    assert abs(sum(phases.values()) - max(0.0, (better.ready - better.created).total_seconds())) < 1e-6
