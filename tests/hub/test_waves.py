"""The hub's rollout decisions (rollout/waves.py): revision bookkeeping, the wave plan and the step, with
hypothesis over random fleets, wave specs and report sequences."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as hs

from embedfleet.compat.identity import hash_identity
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, RolloutWave
from embedfleet.operator.rollout import waves as wv
from embedfleet.operator.rollout.waves import Limits, Member, Report, Rollout

REGIONS = ("eu", "us", "ap")


def _fields(digest_byte: str = "ab", dtype: str = "float32") -> dict[str, Any]:
    return {"source": "hf://org/m", "modelRevision": None, "digest": "sha256:" + digest_byte * 32,
            "dtype": dtype, "quantization": "none", "engine": "torch"}


# ---------------------------------------------------------------- revisions


def test_book_opens_r1_then_a_new_revision_per_new_identity() -> None:
    revs, current, wanted = wv.book([], None, _fields(), False, "t0")
    assert (current, wanted) == ("r1", "r1")
    assert revs[0]["vectorSpace"] == "r1" and revs[0]["state"] == "Serving"
    assert revs[0]["hash"] == hash_identity(_fields())

    same, current, wanted = wv.book(revs, "r1", _fields(), False, "t1")
    assert same == revs and wanted == "r1"

    revs2, current, wanted = wv.book(revs, "r1", _fields(dtype="bfloat16"), False, "t2")
    assert (current, wanted) == ("r1", "r2")
    assert revs2[-1]["state"] == "Candidate" and revs2[-1]["vectorSpace"] == "r1"  # compatible: same space
    again, _, wanted = wv.book(revs2, "r1", _fields(dtype="bfloat16"), False, "t3")
    assert again == revs2 and wanted == "r2"  # the rollout under way is asked for again, not reopened

    revs3, _, wanted = wv.book(revs2, "r1", _fields("cd"), True, "t4")
    assert wanted == "r3" and revs3[-1]["vectorSpace"] == "r3"  # breaking: a space of its own
    assert wv.by_name(revs3, "r2")["state"] == "Retired"  # superseded before it finished


def test_pin_rewrites_identity_and_names_the_revision() -> None:
    revs, _, _ = wv.book([], None, {**_fields(), "modelRevision": "v1"}, False, "t")
    spec: dict[str, Any] = {"model": {"source": "hf://org/other", "revision": "v9", "digest": "sha256:" + "ee" * 32,
                                      "servedModelName": "m"},
                            "runtime": {"dtype": "bfloat16", "maxBatchRequests": 8},
                            "rollout": {"waves": [{"regions": ["eu"]}], "minCosine": 0.99}}
    notes: dict[str, str] = {}
    wv.apply_pin(spec, notes, wv.pin(revs[0], None))
    assert spec["model"] == {"source": "hf://org/m", "revision": "v1", "digest": "sha256:" + "ab" * 32,
                             "servedModelName": "m"}
    assert spec["runtime"]["dtype"] == "float32" and spec["runtime"]["maxBatchRequests"] == 8
    assert spec["rollout"] == {"minCosine": 0.99}  # waves are the hub's own
    assert notes == {wv.REVISION_ANNOTATION: "r1", wv.VECTOR_SPACE_ANNOTATION: "r1"}


# ---------------------------------------------------------------- the plan


def test_plan_by_region_cluster_and_labels_with_a_last_wave() -> None:
    members = {"a": Member("eu"), "b": Member("us", {"tier": "canary"}), "c": Member("us"), "d": Member("ap")}
    spec = [RolloutWave(regions=["eu"]), RolloutWave(name="canary", cluster_selector={"tier": "canary"}),
            RolloutWave(clusters=["c", "a"], soak_seconds=5)]
    plan = wv.plan(spec, members)
    assert [w.clusters for w in plan] == [("a",), ("b",), ("c",), ("d",)]
    assert [w.name for w in plan] == ["wave-1", "canary", "wave-3", "rest"]
    assert wv.plan([], members) == [wv.Wave("all", ("a", "b", "c", "d"), 0, 0.0)]


# ---------------------------------------------------------------- the step, by hypothesis

NAMES = [f"c{i}" for i in range(6)]


@hs.composite
def fleets(draw: hs.DrawFn) -> tuple[list[wv.Wave], dict[str, Member]]:
    members = {n: Member(draw(hs.sampled_from(REGIONS))) for n in draw(hs.lists(hs.sampled_from(NAMES), min_size=1,
                                                                                  max_size=6, unique=True))}
    specs = [RolloutWave(regions=draw(hs.lists(hs.sampled_from(REGIONS), max_size=2, unique=True)),
                         clusters=draw(hs.lists(hs.sampled_from(NAMES), max_size=2, unique=True)),
                         max_failures=draw(hs.integers(0, 1)), soak_seconds=draw(hs.sampled_from([0, 5, 30])))
             for _ in range(draw(hs.integers(0, 3)))]
    return wv.plan(specs, members), members


reports_st = hs.builds(
    Report,
    current=hs.sampled_from([None, "r1", "r2"]),
    available=hs.sampled_from([None, True, True, False]),
    blocked=hs.sampled_from([None, None, None, "DriftTooHigh: cosine 0.91"]),
)


def _limits(breaking: bool = False) -> Limits:
    return Limits(max_error_rate=0.05, report_timeout=100.0, breaking=breaking)


def _moved_waves(rollout: Rollout, plan: list[wv.Wave]) -> int:
    """How many waves' clusters the targets move to the new revision (the smallest prefix covering them)."""
    moved = {c for c, r in wv.targets(rollout, plan).items() if r == rollout.new != rollout.old}
    return max([i + 1 for i, w in enumerate(plan) if set(w.clusters) & moved] + [0])


@settings(max_examples=150, deadline=None)
@given(fleets(), hs.lists(hs.tuples(hs.dictionaries(hs.sampled_from(NAMES), reports_st), hs.integers(0, 60)),
                          min_size=1, max_size=12))
def test_step_properties(fleet: tuple[list[wv.Wave], dict[str, Member]],
                         rounds: list[tuple[dict[str, Report], int]]) -> None:
    plan, members = fleet
    assert sorted(c for w in plan for c in w.clusters) == sorted(members)  # every cluster in exactly one wave
    rollout = Rollout("r1", "r2", "Pending")
    now = 0.0
    started_wave = -1
    for reports, gap in rounds:
        now += gap
        before = rollout
        rollout = wv.step(rollout, plan, reports, now, _limits())
        # Idempotent: a second step at the same moment with the same reports changes nothing.
        assert wv.step(rollout, plan, reports, now, _limits()) == rollout
        targets = wv.targets(rollout, plan)
        assert set(targets) == set(members)
        if rollout.phase == wv.ROLLED_BACK:
            assert set(targets.values()) == {"r1"}, targets  # every cluster back on the old revision
            assert rollout.failures and "rolled back" in rollout.message
            continue
        if rollout.phase == wv.WAVES:
            # Never more waves moved than the plan allows: the waves up to the one in progress, no further.
            assert _moved_waves(rollout, plan) <= rollout.wave + 1
            for i, wave in enumerate(plan):
                for c in wave.clusters:
                    assert (targets[c] == "r2") == (i <= rollout.wave), (c, i, rollout)
            # At most one wave further per step past a wave that was not yet soaked at the previous step.
            if before.phase == wv.WAVES and rollout.wave > before.wave:
                assert rollout.wave_started == now
            started_wave = max(started_wave, rollout.wave)
        if rollout.phase == wv.DONE:
            assert set(targets.values()) == {"r2"}
        if rollout.phase == wv.DONE and before.phase != wv.DONE:
            # Done means every cluster of the last wave reported r2 current and Available at the step that
            # finished, or failed within its wave's allowance.
            last = plan[-1]
            healthy = [c for c in last.clusters if reports.get(c, Report()).current == "r2"
                       and reports.get(c, Report()).available]
            assert len(last.clusters) - len(healthy) <= last.max_failures


@settings(max_examples=60, deadline=None)
@given(fleets(), hs.integers(0, len(NAMES) - 1))
def test_a_blocked_cluster_rolls_back_every_moved_cluster(fleet: tuple[list[wv.Wave], dict[str, Member]],
                                                          pick: int) -> None:
    plan, members = fleet
    healthy = {c: Report(current="r2", available=True) for c in members}
    rollout = wv.step(Rollout("r1", "r2", "Pending"), plan, {}, 0.0, _limits())
    now = 0.0
    victim = sorted(members)[pick % len(members)]
    wave_of = next(i for i, w in enumerate(plan) if victim in w.clusters)
    others = {c: r for c, r in healthy.items() if c != victim}
    while rollout.phase == wv.WAVES and rollout.wave < wave_of:  # every wave before the victim's passes
        now += 31
        rollout = wv.step(rollout, plan, others, now, _limits())
    assert rollout.phase == wv.WAVES and rollout.wave == wave_of
    assert wv.targets(rollout, plan)[victim] == "r2"
    reports = {**healthy, victim: Report(current="r1", available=True, blocked="DriftTooHigh: cosine 0.9")}
    rollout = wv.step(rollout, plan, reports, now + 1, _limits())
    if plan[wave_of].max_failures >= 1:
        assert rollout.phase in (wv.WAVES, wv.DONE)  # one failure is within this wave's allowance
        return
    assert rollout.phase == wv.ROLLED_BACK
    assert set(wv.targets(rollout, plan).values()) == {"r1"}
    assert victim in rollout.message and "DriftTooHigh" in rollout.message


def test_waves_soak_then_advance_and_clusters_outside_never_move() -> None:
    members = {"eu1": Member("eu"), "us1": Member("us"), "ap1": Member("ap")}
    plan = wv.plan([RolloutWave(regions=["eu"], soak_seconds=30), RolloutWave(regions=["us"], soak_seconds=30)],
                   members)
    r = wv.step(Rollout("r1", "r2", "Pending"), plan, {}, 100.0, _limits())
    assert (r.phase, r.wave) == (wv.WAVES, 0)
    assert wv.targets(r, plan) == {"eu1": "r2", "us1": "r1", "ap1": "r1"}
    eu_ok = {"eu1": Report(current="r2", available=True)}
    r = wv.step(r, plan, eu_ok, 110.0, _limits())
    assert (r.wave, r.healthy_since) == (0, 110.0)  # soak starts when the wave is first seen healthy
    assert wv.step(r, plan, eu_ok, 139.0, _limits()).wave == 0
    r = wv.step(r, plan, eu_ok, 140.0, _limits())
    assert (r.wave, r.wave_started) == (1, 140.0)
    assert wv.targets(r, plan) == {"eu1": "r2", "us1": "r2", "ap1": "r1"}
    # A moved cluster that does not report within the timeout fails its wave.
    late = wv.step(r, plan, eu_ok, 140.0 + 101, _limits())
    assert late.phase == wv.ROLLED_BACK and "did not report r2" in late.message
    both = {**eu_ok, "us1": Report(current="r2", available=True)}
    r = wv.step(r, plan, both, 150.0, _limits())
    r = wv.step(r, plan, {**both, "ap1": Report(current="r2", available=True)}, 180.0, _limits())
    assert r.phase == wv.DONE and set(wv.targets(r, plan).values()) == {"r2"}


def test_breaking_goes_side_by_side_and_flips_on_query_revision() -> None:
    members = {"eu1": Member("eu")}
    plan = wv.plan([], members)
    r = wv.step(Rollout("r1", "r2", "Pending"), plan, {}, 0.0, _limits(True))
    side = {"eu1": Report(current="r1", live=frozenset({"r1", "r2"}), available=True)}
    r = wv.step(r, plan, side, 1.0, _limits(True))
    assert r.phase == wv.SIDE_BY_SIDE
    assert wv.query_for(r, None) is None and wv.query_for(r, "r2") == "r2"
    assert not wv.flipped(r, plan, side, "r2")
    assert wv.flipped(r, plan, {"eu1": Report(current="r2", available=True)}, "r2")


def _spec(**rollout: Any) -> EmbeddingDeploymentSpec:
    return EmbeddingDeploymentSpec.model_validate({
        "model": {"source": "hf://org/m", "digest": "sha256:" + "ab" * 32},
        "runtime": {"dtype": rollout.pop("dtype", "float32")}, "rollout": rollout})


def _copy(annotation: str, current: str | None, generation: int = 1, **conds: str) -> dict[str, Any]:
    return {"metadata": {"generation": generation, "annotations": {wv.REVISION_ANNOTATION: annotation}},
            "status": {"observedGeneration": generation, "currentRevision": current,
                       "conditions": [{"type": t, "status": s, "reason": "X", "message": f"{t} msg"}
                                      for t, s in conds.items()]}}


def test_decide_books_rolls_and_rolls_back_from_status() -> None:
    members = {"eu1": Member("eu"), "us1": Member("us")}
    spec1 = _spec(waves=[{"regions": ["eu"], "soakSeconds": 10}])
    stamp, parse = (lambda t: f"T{t}"), (lambda s: float(s[1:]) if s else None)
    d = wv.decide({}, spec1, members, {}, 0.0, None, stamp, parse)
    assert d.status["currentRevision"] == "r1" and d.status["rollout"]["phase"] == wv.IDLE and d.blocked is None
    assert {c: p["name"] for c, p in d.pins.items()} == {"eu1": "r1", "us1": "r1"}
    status = dict(d.status)
    spec2 = _spec(dtype="bfloat16", waves=[{"regions": ["eu"], "soakSeconds": 10}])
    d = wv.decide(status, spec2, members, {}, 5.0, None, stamp, parse)
    assert d.status["rollout"] == {"phase": "Waves", "revision": "r2", "wave": 0, "wavesTotal": 2,
                                   "waveStartedAt": "T5.0", "message": "r2: wave 1/2 (wave-1)"}
    assert {c: p["name"] for c, p in d.pins.items()} == {"eu1": "r2", "us1": "r1"}
    assert d.pins["eu1"]["runtime"]["dtype"] == "bfloat16" and d.pins["us1"]["runtime"]["dtype"] == "float32"
    status = dict(d.status)
    # A RolloutBlocked left from before the copy carried r2 does not count; one for r2 does.
    stale = {"eu1": _copy("r1", "r1", RolloutBlocked="True", Available="True")}
    assert wv.decide(status, spec2, members, stale, 6.0, None, stamp, parse).rollout.phase == wv.WAVES
    blocked = {"eu1": _copy("r2", "r1", RolloutBlocked="True", Available="True")}
    d = wv.decide(status, spec2, members, blocked, 7.0, None, stamp, parse)
    assert d.status["rollout"]["phase"] == wv.ROLLED_BACK and d.blocked[0] is True
    assert "eu1" in d.blocked[2] and "RolloutBlocked" in d.blocked[2]
    assert {c: p["name"] for c, p in d.pins.items()} == {"eu1": "r1", "us1": "r1"}
    assert wv.by_name(d.status["revisions"], "r2")["state"] == "Blocked"
    assert d.status["currentRevision"] == "r1"
    # Rolled back stays rolled back for this spec; the old spec again clears it.
    again = wv.decide(dict(d.status), spec2, members, blocked, 100.0, None, stamp, parse)
    assert again.status == d.status
    back = wv.decide(dict(d.status), spec1, members, {}, 101.0, None, stamp, parse)
    assert back.status["rollout"]["phase"] == wv.DONE and back.blocked[0] is False
