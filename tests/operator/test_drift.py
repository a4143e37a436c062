"""Probe drift monitoring in the operator (docs/rollouts.md, "Drift monitoring").

The verdict (rollout/drift.py) worked through by hand and hunted by hypothesis; the Degraded condition it
folds into (operator/status.py); the probe gauges read from the same /metrics scrape as the in-flight
gauge, from a real `embedfleet serve` and from real metric servers reporting a drifted probe; and the
Prometheus source's per-pod query against a real Prometheus.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as hs
from tests.observability.prometheus import PROMETHEUS, scrape_config, start_prometheus
from tests.procs import ROOT

from embedfleet.operator import status as st
from embedfleet.operator.rollout.drift import REASON, DriftVerdict, ProbeSample, assess, changed, degraded
from embedfleet.operator.signals import Target, parse_probe, query_probe, scrape, scrape_pod

HERE = Path(__file__).resolve().parent
BAR = 0.999

# ---------------------------------------------------------------- the verdict, worked examples


def test_one_pod_below_the_bar_is_named_with_its_figure() -> None:
    verdict = assess({"web-a": ProbeSample(1.0, True), "web-b": ProbeSample(0.9, True),
                      "web-c": ProbeSample(0.9995, True)}, BAR)
    assert verdict.drifted
    assert verdict.pods == ["web-b"]
    assert verdict.min_cosine == 0.9
    assert "worst web-b cosine 0.900000" in verdict.message and "minCosine 0.999" in verdict.message
    assert "1 of 3" in verdict.message


def test_lost_order_drifts_even_at_a_high_cosine_and_the_lowest_cosine_comes_first() -> None:
    verdict = assess({"a": ProbeSample(0.9999, False), "b": ProbeSample(0.95, True), "c": ProbeSample(1.0, True)},
                     BAR)
    assert verdict.drifted and verdict.pods == ["b", "a"]
    assert "worst b cosine 0.950000" in verdict.message
    assert "a: cosine 0.999900, similarity order lost" in verdict.message


def test_every_pod_in_tolerance_is_not_drifted_and_says_the_lowest_figure() -> None:
    verdict = assess({"a": ProbeSample(0.99991, True), "b": ProbeSample(1.0, True), "new": ProbeSample()}, BAR)
    assert not verdict.drifted and verdict.pods == []
    assert verdict.min_cosine == 0.99991
    assert "within tolerance on 2 pod(s)" in verdict.message and "1 not re-checked yet" in verdict.message


def test_pods_that_never_re_checked_give_no_verdict_to_write() -> None:
    verdict = assess({"a": ProbeSample(), "b": ProbeSample()}, BAR)
    assert not verdict.drifted and verdict.min_cosine is None
    assert not changed(None, verdict)  # nothing to say: a deployment with the probe off is never written
    # ...but a drift that was written clears once only unchecked pods are left (the drifted ones went).
    before = assess({"old": ProbeSample(0.5, True)}, BAR).status("2026-01-01T00:00:00Z")
    assert changed(before, verdict)


def test_a_steady_verdict_is_not_rewritten_and_a_moved_figure_is() -> None:
    first = assess({"a": ProbeSample(0.9, True)}, BAR)
    written = first.status("2026-01-01T00:00:00Z")
    assert written["checkedAt"] == "2026-01-01T00:00:00Z" and written["drifted"] is True
    assert not changed(written, assess({"a": ProbeSample(0.9000001, True)}, BAR))  # below the 6th decimal
    assert changed(written, assess({"a": ProbeSample(0.8, True)}, BAR))
    assert changed(written, assess({"a": ProbeSample(1.0, True)}, BAR))


# ---------------------------------------------------------------- the verdict, invariants

_pod_names = hs.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
_cosines = hs.one_of(hs.none(), hs.floats(min_value=-1.0, max_value=1.0, allow_nan=False))
_samples = hs.builds(ProbeSample, _cosines, hs.one_of(hs.none(), hs.booleans()))
_fleets = hs.dictionaries(_pod_names, _samples, max_size=12)
_bars = hs.floats(min_value=0.5, max_value=1.0, exclude_min=True)


@given(_fleets, _bars)
def test_drifted_exactly_when_some_pod_is_out_of_tolerance(fleet: dict[str, ProbeSample], bar: float) -> None:
    verdict = assess(fleet, bar)
    out = {pod for pod, s in fleet.items()
           if (s.cosine is not None and s.cosine < bar) or s.order_kept is False}
    assert verdict.drifted == bool(out)
    assert set(verdict.pods) == out and len(verdict.pods) == len(out)
    if out:
        assert f"worst {verdict.pods[0]} " in verdict.message
        worst = fleet[verdict.pods[0]]
        assert all((worst.cosine if worst.cosine is not None else math.inf)
                   <= (fleet[p].cosine if fleet[p].cosine is not None else math.inf) for p in verdict.pods)
    cosines = [s.cosine for s in fleet.values() if s.cosine is not None]
    assert verdict.min_cosine == (round(min(cosines), 6) if cosines else None)
    assert len(verdict.message) <= 4096


@given(_fleets, _bars, _bars)
def test_a_higher_bar_never_clears_a_pod(fleet: dict[str, ProbeSample], a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert set(assess(fleet, low).pods) <= set(assess(fleet, high).pods)


@given(_fleets, _bars)
def test_the_verdict_ignores_the_order_pods_are_listed_in(fleet: dict[str, ProbeSample], bar: float) -> None:
    assert assess(dict(reversed(list(fleet.items()))), bar) == assess(fleet, bar)


@given(_fleets, _bars, hs.text(max_size=20))
def test_what_was_written_is_never_news(fleet: dict[str, ProbeSample], bar: float, stamp: str) -> None:
    verdict = assess(fleet, bar)
    assert not changed(verdict.status(stamp), verdict)


# ---------------------------------------------------------------- Degraded


def _deployment(failing: bool) -> dict:
    conditions = [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}]
    if failing:
        conditions.append({"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                           "message": "exceeded quota"})
    return {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "conditions": conditions}}


def _degraded(probe_drift: dict | None, failing: bool = False) -> dict:
    conditions, _ = st.observed_conditions(deployment=_deployment(failing), cache_nodes=None, desired=2,
                                           generation=3, probe_drift=probe_drift)
    return next(c for c in conditions if c["type"] == "Degraded")


def test_a_drifted_probe_makes_degraded_true_and_tolerance_makes_it_false_again() -> None:
    drifted = assess({"web-b": ProbeSample(0.9, True), "web-a": ProbeSample(1.0, True)}, BAR).status("t")
    cond = _degraded(drifted)
    assert (cond["status"], cond["reason"]) == ("True", REASON)
    assert "web-b" in cond["message"] and "0.900000" in cond["message"]
    assert cond["observedGeneration"] == 3
    fine = assess({"web-b": ProbeSample(1.0, True), "web-a": ProbeSample(1.0, True)}, BAR).status("t")
    assert (_degraded(fine)["status"], _degraded(fine)["reason"]) == ("False", "Healthy")
    assert _degraded(None)["status"] == "False"


def test_the_deployments_own_failure_keeps_the_reason_and_the_drift_is_still_said() -> None:
    drifted = assess({"web-b": ProbeSample(0.9, True)}, BAR).status("t")
    cond = _degraded(drifted, failing=True)
    assert (cond["status"], cond["reason"]) == ("True", "DeploymentFailing")
    assert "exceeded quota" in cond["message"] and f"{REASON}: " in cond["message"]
    assert "web-b" in cond["message"]
    assert _degraded(None, failing=True)["message"] == "ReplicaFailure: exceeded quota"


@given(hs.booleans(), hs.one_of(hs.none(), hs.builds(
    lambda d, m: {"drifted": d, "message": m}, hs.booleans(), hs.text(min_size=1, max_size=30))))
def test_degraded_is_true_exactly_when_the_deployment_fails_or_the_probe_drifted(
        failing: bool, probe_drift: dict | None) -> None:
    own = st.condition("Degraded", failing, "DeploymentFailing" if failing else "Healthy", "x")
    folded = degraded(probe_drift, own)
    assert (folded["status"] == "True") == (failing or bool(probe_drift and probe_drift["drifted"]))
    assert folded["type"] == "Degraded"


# ---------------------------------------------------------------- the scrape: a real runtime


def _runtime_exports_probe() -> bool:
    """Whether this tree's runtime declares the probe gauges (the runtime's half of the contract)."""
    return "embedfleet_probe_cosine" in (ROOT / "runtime" / "embedfleet" / "runtime" / "metrics.py").read_text()


def _scrape_one(port: int) -> object:
    async def go() -> object:
        async with httpx.AsyncClient() as client:
            return await scrape_pod(client, Target("pod-0", f"http://127.0.0.1:{port}/metrics"), 10.0)

    return asyncio.run(go())


def test_a_real_runtime_with_the_probe_off_reads_as_not_re_checked(runtime_factory) -> None:
    """The same scrape the autoscaler makes: its in-flight gauge, and no probe figures (probe off)."""
    srv = runtime_factory(env={"EMBEDFLEET_PROBE_INTERVAL": "0"})
    reading = _scrape_one(srv.port)
    assert reading.ok and reading.in_flight == 0.0
    assert (reading.probe_cosine, reading.probe_order_kept) == (None, None)
    assert not changed(None, assess({reading.pod: ProbeSample(reading.probe_cosine, reading.probe_order_kept)},
                                    BAR))


def test_a_real_runtime_re_checking_its_probe_reads_as_in_tolerance(runtime_factory) -> None:
    if not _runtime_exports_probe():
        pytest.skip("runtime/embedfleet/runtime/metrics.py does not export embedfleet_probe_cosine yet")
    srv = runtime_factory(env={"EMBEDFLEET_PROBE_INTERVAL": "1"})
    deadline = time.monotonic() + 120
    reading = _scrape_one(srv.port)
    while reading.probe_cosine is None:  # a wait for the first periodic re-check, not a speed check
        assert time.monotonic() < deadline, f"no probe re-check exported in 120 s: {reading}"
        time.sleep(0.5)
        reading = _scrape_one(srv.port)
    assert reading.ok and reading.probe_cosine >= BAR and reading.probe_order_kept is True
    verdict = assess({reading.pod: ProbeSample(reading.probe_cosine, reading.probe_order_kept)}, BAR)
    assert not verdict.drifted and verdict.min_cosine is not None


# ---------------------------------------------------------------- the scrape: drifted pods


class FakeRuntime:
    """tests/operator/fake_runtime_metrics.py: a real HTTP server exporting the runtime's metric contract."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fake_runtime_metrics.py"), "--port", "0"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("listening on "), line
        self.port = int(line.split()[-1])

    def set(self, **values: object) -> None:
        httpx.post(f"http://127.0.0.1:{self.port}/set", json={"in_flight": 0, **values},
                   timeout=5).raise_for_status()

    def target(self, pod: str) -> Target:
        return Target(pod, f"http://127.0.0.1:{self.port}/metrics")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def fakes() -> Iterator[Callable[[], FakeRuntime]]:
    started: list[FakeRuntime] = []

    def start() -> FakeRuntime:
        started.append(FakeRuntime())
        return started[-1]

    yield start
    for fake in started:
        fake.stop()


def test_a_drifted_pod_is_found_in_the_autoscalers_own_scrape(fakes: Callable[[], FakeRuntime]) -> None:
    good, bad, fresh, lost = fakes(), fakes(), fakes(), fakes()
    good.set(in_flight=3, probe_cosine=1.0, probe_order_kept=1)
    bad.set(in_flight=1, probe_cosine=0.9, probe_order_kept=1)
    fresh.set(in_flight=2)  # started, not re-checked yet
    lost.set(probe_cosine=0.99995, probe_order_kept=0)
    reading = asyncio.run(scrape([good.target("web-a"), bad.target("web-b"), fresh.target("web-c"),
                                  lost.target("web-d")]))
    assert reading.in_flight == 6.0  # the autoscaler's number is untouched by the probe gauges
    samples = {r.pod: ProbeSample(r.probe_cosine, r.probe_order_kept) for r in reading.pods}
    assert samples["web-c"] == ProbeSample()
    verdict = assess(samples, BAR)
    assert verdict.drifted and verdict.pods == ["web-b", "web-d"]
    assert verdict.min_cosine == 0.9 and "worst web-b cosine 0.900000" in verdict.message
    assert "1 not re-checked yet" in verdict.message
    # Back in tolerance: the same pods, a verdict that clears.
    bad.set(in_flight=1, probe_cosine=1.0, probe_order_kept=1)
    lost.set(probe_cosine=1.0, probe_order_kept=1)
    reading = asyncio.run(scrape([good.target("web-a"), bad.target("web-b"), lost.target("web-d")]))
    assert not assess({r.pod: ProbeSample(r.probe_cosine, r.probe_order_kept) for r in reading.pods}, BAR).drifted


def test_a_pod_serving_two_models_reports_its_worst() -> None:
    text = ("# TYPE embedfleet_probe_cosine gauge\n"
            'embedfleet_probe_cosine{model="a"} 0.9999\nembedfleet_probe_cosine{model="b"} 0.97\n'
            "# TYPE embedfleet_probe_order_kept gauge\n"
            'embedfleet_probe_order_kept{model="a"} 1\nembedfleet_probe_order_kept{model="b"} 0\n'
            'embedfleet_probe_cosine{model="c"} NaN\n')
    assert parse_probe(text) == (0.97, False)
    assert parse_probe("# TYPE embedfleet_requests_in_flight gauge\nembedfleet_requests_in_flight 0\n") == (None, None)


# ---------------------------------------------------------------- the Prometheus source


@pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="the `prometheus` binary is not installed")
def test_prometheus_gives_each_pods_worst_figures(fakes: Callable[[], FakeRuntime]) -> None:
    a, b, other = fakes(), fakes(), fakes()
    a.set(probe_cosine=1.0, probe_order_kept=1)
    b.set(probe_cosine=0.93, probe_order_kept=1)
    other.set(probe_cosine=0.1, probe_order_kept=0)  # another deployment's pod: never in this answer
    labels = {"namespace": "ml", "service": "minilm"}
    prom = start_prometheus(scrape_config({"runtime": [
        (f"127.0.0.1:{a.port}", {**labels, "pod": "minilm-a"}),
        (f"127.0.0.1:{b.port}", {**labels, "pod": "minilm-b"}),
        (f"127.0.0.1:{other.port}", {"namespace": "ml", "service": "bge", "pod": "bge-a"})]}, []))
    try:
        deadline = time.monotonic() + 60
        readings = query_probe(prom.url, "ml", "minilm", "minilm")
        while readings is None or len(readings) < 2 or any(r.probe_order_kept is None for r in readings):
            assert time.monotonic() < deadline, f"prometheus never had both pods: {readings}"  # scrape wait
            time.sleep(0.5)
            readings = query_probe(prom.url, "ml", "minilm", "minilm")
        by_pod = {r.pod: r for r in readings}
        assert set(by_pod) == {"minilm-a", "minilm-b"}
        assert by_pod["minilm-b"].probe_cosine == 0.93 and by_pod["minilm-b"].probe_order_kept is True
        verdict = assess({r.pod: ProbeSample(r.probe_cosine, r.probe_order_kept) for r in readings}, BAR)
        assert verdict.drifted and verdict.pods == ["minilm-b"]
        assert query_probe("http://127.0.0.1:9", "ml", "minilm", "minilm") is None  # unreachable: no verdict
    finally:
        prom.stop()


def test_a_verdict_is_a_status_object_the_crd_accepts() -> None:
    from embedfleet.operator.crd.statuses import ProbeDriftStatus

    verdict: DriftVerdict = assess({"a": ProbeSample(0.5, False)}, BAR)
    parsed = ProbeDriftStatus.model_validate(verdict.status("2026-01-01T00:00:00Z"))
    assert parsed.drifted and parsed.pods == ["a"] and parsed.min_cosine == 0.5
