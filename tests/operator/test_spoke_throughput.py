"""The spoke's throughput figures (spoke/throughput.py): the window per pod between scrapes, the aggregate per
(model, resource), when the heartbeat rewrites its annotation, and the counters read from a real
`embedfleet serve` through the autoscaler's own scrape."""

from __future__ import annotations

import asyncio

import httpx
from hypothesis import given
from hypothesis import strategies as hs
from tests.procs import RuntimeServer

from embedfleet.operator.scheduling import learn
from embedfleet.operator.signals import Target, parse_engine_counters, scrape_pod
from embedfleet.operator.spoke import heartbeat
from embedfleet.operator.spoke.throughput import (
    CHANGE,
    MAX_AGE_S,
    Counters,
    Measured,
    Registry,
    Window,
    advance,
    aggregate,
    noticeable,
    resource_of,
)

# ---------------------------------------------------------------- windows, worked examples


def test_a_first_scrape_only_sets_baselines_and_the_next_gives_inputs_per_busy_second() -> None:
    kept, window = advance({}, {"a": Counters(100, 1.0)})
    assert window is None and kept == {"a": Counters(100, 1.0)}
    kept, window = advance(kept, {"a": Counters(1100, 3.0)})
    assert window == Window(1000, 2.0) and window.rate == 500
    assert kept == {"a": Counters(1100, 3.0)}


def test_a_restarted_pod_gives_nothing_and_starts_over() -> None:
    kept, window = advance({"a": Counters(5000, 10.0)}, {"a": Counters(40, 0.1)})
    assert window is None and kept == {"a": Counters(40, 0.1)}


def test_light_traffic_adds_up_until_it_says_something() -> None:
    kept, window = advance({"a": Counters(0, 0.0)}, {"a": Counters(10, 0.2)})
    assert window is None and kept == {"a": Counters(0, 0.0)}  # the baseline stays
    _, window = advance(kept, {"a": Counters(300, 1.5)})
    assert window == Window(300, 1.5)


def test_a_pod_that_stopped_answering_is_forgotten() -> None:
    kept, _ = advance({"a": Counters(1, 1.0), "b": Counters(1, 1.0)}, {"a": Counters(2, 1.0)})
    assert set(kept) == {"a"}


def test_two_replicas_weigh_by_their_busy_seconds() -> None:
    base = {"a": Counters(0, 0.0), "b": Counters(0, 0.0)}
    _, window = advance(base, {"a": Counters(1000, 1.0), "b": Counters(3000, 3.0)})
    assert window is not None and window.rate == 1000


# ---------------------------------------------------------------- windows, properties

counters = hs.builds(Counters, hs.floats(0, 1e9), hs.floats(0, 1e6))
fleets = hs.dictionaries(hs.sampled_from("abcdef"), counters, max_size=6)


@given(fleets, fleets, hs.floats(1, 1000), hs.floats(0.01, 10))
def test_windows_are_never_negative_and_never_count_a_reset_or_a_thin_pod(
        before: dict[str, Counters], after: dict[str, Counters], min_inputs: float, min_busy: float) -> None:
    kept, window = advance(before, after, min_inputs, min_busy)
    assert set(kept) == set(after)
    contributing = {p for p in after if p in before and after[p].inputs - before[p].inputs >= min_inputs
                    and after[p].busy_s - before[p].busy_s >= min_busy}
    if window is None:
        assert not contributing
        return
    assert window.inputs >= 0 and window.busy_s > 0
    assert window.inputs == sum(after[p].inputs - before[p].inputs for p in after if p in contributing)
    assert window.busy_s == sum(after[p].busy_s - before[p].busy_s for p in after if p in contributing)
    for pod, base in kept.items():
        assert base == after[pod] or (pod in before and base == before[pod])


@given(fleets)
def test_a_scrape_of_the_same_counters_gives_nothing(fleet: dict[str, Counters]) -> None:
    assert advance(fleet, fleet) == (fleet, None)


# ---------------------------------------------------------------- aggregate and change

measured = hs.builds(Measured, hs.sampled_from(["m1", "m2@v2", "m3"]), hs.sampled_from(["cpu", "nvidia-l4"]),
                     hs.builds(Window, hs.floats(0, 1e6), hs.floats(0, 1e4)), hs.just(0.0))


def test_deployments_of_one_model_on_one_resource_make_one_entry() -> None:
    entries = aggregate([Measured("m", "cpu", Window(100, 1.0), 0), Measured("m", "cpu", Window(300, 1.0), 0),
                         Measured("m", "nvidia-l4", Window(5000, 1.0), 0)])
    assert entries == [("m", "cpu", 200.0), ("m", "nvidia-l4", 5000.0)]


@given(hs.lists(measured, max_size=40), hs.integers(1, 6))
def test_the_aggregate_is_bounded_positive_and_a_valid_annotation(ms: list[Measured], cap: int) -> None:
    entries = aggregate(ms, cap)
    assert len(entries) <= cap and entries == sorted(entries)
    assert len({(m, r) for m, r, _ in entries}) == len(entries)
    assert all(rate > 0 for _, _, rate in entries)
    parsed = learn.parse(learn.annotation(entries))
    assert [(m, r) for m, r, _ in parsed] == [(m, r) for m, r, _ in entries]


def test_the_lease_is_rewritten_for_a_move_beyond_the_threshold_not_for_noise() -> None:
    written = learn.annotation([("m", "cpu", 200.0)])
    assert not noticeable(written, [("m", "cpu", 200.0 * (1 + CHANGE / 2))])
    assert noticeable(written, [("m", "cpu", 200.0 * (1 + 2 * CHANGE))])
    assert noticeable(written, [("m", "cpu", 200.0), ("m", "nvidia-l4", 9000.0)])
    assert noticeable(None, [("m", "cpu", 1.0)])
    assert not noticeable(written, [])  # a beat never removes what is written


@given(hs.lists(measured, min_size=1, max_size=10))
def test_what_was_just_written_is_never_rewritten(ms: list[Measured]) -> None:
    entries = aggregate(ms)
    if entries:
        assert not noticeable(learn.annotation(entries), entries)
        lease = {"metadata": {"annotations": {heartbeat.THROUGHPUT_ANNOTATION: learn.annotation(entries)}}}
        assert heartbeat.throughput_update(lease, entries) is None
        assert heartbeat.throughput_update(None, entries) == learn.annotation(entries)


def test_cpu_without_gpus_the_gpu_type_with_them_and_nothing_for_an_unnamed_gpu() -> None:
    assert resource_of(0, "nvidia-l4") == "cpu"
    assert resource_of(1, "nvidia-l4") == "nvidia-l4"
    assert resource_of(1, None) is None


def test_the_registry_keeps_recent_windows_per_deployment_and_drops_old_ones() -> None:
    now = [0.0]
    reg = Registry(clock=lambda: now[0])
    reg.record("ns/a", "m", "cpu", Window(100, 1.0))
    reg.record("ns/a", "m", "cpu", Window(300, 1.0))
    reg.record("ns/b", "m", "cpu", Window(600, 1.0))
    assert reg.entries() == [("m", "cpu", 1000 / 3)]
    reg.record("ns/a", "m@v2", "cpu", Window(50, 1.0))  # a new revision starts the deployment over
    assert reg.entries() == [("m", "cpu", 600.0), ("m@v2", "cpu", 50.0)]
    now[0] = MAX_AGE_S / 2
    reg.record("ns/b", "m", "cpu", Window(600, 1.0))
    now[0] = MAX_AGE_S + 1
    assert reg.entries() == [("m", "cpu", 600.0)]
    reg.forget("ns/b")
    assert reg.entries() == []


# ---------------------------------------------------------------- a real runtime, the autoscaler's scrape


def _scrape(port: int) -> Counters:
    async def go() -> Counters:
        async with httpx.AsyncClient() as client:
            reading = await scrape_pod(client, Target("pod-0", f"http://127.0.0.1:{port}/metrics"), 10.0)
        assert reading.ok and reading.inputs is not None and reading.busy_s is not None, reading
        return Counters(reading.inputs, reading.busy_s)

    return asyncio.run(go())


def test_a_real_runtimes_counters_give_a_rate_through_the_autoscalers_scrape(server: RuntimeServer) -> None:
    kept, window = advance({}, {"pod-0": _scrape(server.port)}, min_inputs=40, min_busy_s=0.001)
    assert window is None
    with server.client() as c:
        for _ in range(4):
            assert c.post("/v1/embeddings", json={"input": [f"text {i}" for i in range(10)]}).status_code == 200
    _, window = advance(kept, {"pod-0": _scrape(server.port)}, min_inputs=40, min_busy_s=0.001)
    assert window is not None and window.inputs == 40 and window.rate > 0


def test_counters_are_summed_over_models_and_absent_ones_are_none() -> None:
    text = ('embedfleet_inputs_total{model="a"} 10\nembedfleet_inputs_total{model="b"} 5\n'
            'embedfleet_engine_busy_seconds_total{model="a"} 0.5\n')
    assert parse_engine_counters(text) == (15.0, 0.5)
    assert parse_engine_counters("embedfleet_requests_in_flight 0\n") == (None, None)
