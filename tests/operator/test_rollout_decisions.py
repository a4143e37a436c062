"""rollout.revisions.decide and what render makes of its runs: pure, example- and property-based.

Probe outputs here are a function of the identity, as they are of a real runtime: the weights (source)
decide the vectors, a lower precision moves them by a hair. So a dtype change passes the drift gate and a
change of weights does not, without anything being stubbed in the decision.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedfleet.compat.identity import identity
from embedfleet.operator import status as status_mod
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.render import render
from embedfleet.operator.rollout.revisions import (
    UNGATED,
    Observed,
    Plan,
    ProbeRead,
    decide,
    needs_observation,
    recorded_runs,
    rolled_revision,
)

NAME = "emb"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SOURCES = ("file:///models/a", "file:///models/b", "file:///models/c")
DTYPES = ("float32", "bfloat16")
_rng = np.random.default_rng(7)
WEIGHTS = {source: _rng.normal(size=(12, 16)) for source in SOURCES}
NOISE = _rng.normal(size=(12, 16)) * 1e-4


def spec_of(source: str = SOURCES[0], dtype: str = "float32", compatibility: str = "compatible",
            query_revision: str | None = None, timeout: float = 600) -> EmbeddingDeploymentSpec:
    rollout: dict[str, Any] = {"gateTimeoutSeconds": timeout}
    if query_revision:
        rollout["queryRevision"] = query_revision
    return EmbeddingDeploymentSpec.model_validate({
        "model": {"source": source, "servedModelName": "bge"}, "runtime": {"dtype": dtype},
        "compatibility": compatibility, "rollout": rollout})


def probe_of(record: dict[str, Any]) -> dict[str, Any]:
    """What a runtime of this revision answers on GET .../probe."""
    outputs = WEIGHTS[record["source"]] + (NOISE if record["dtype"] != "float32" else 0)
    return {"task": "embed", "outputs": outputs.tolist(), "probe_set": "probe-v1",
            "fingerprint": f"sha256:{record['source'][-1]}{record['dtype']}"}


def step(spec: EmbeddingDeploymentSpec, status: dict[str, Any], now: datetime, *, ready: dict[str, int] | None = None,
         primary: str | None = None, errors: frozenset[str] = frozenset(), read_probes: bool = True,
         hub: str | None = None) -> tuple[Plan, Observed]:
    """decide() as the handler calls it: a first pass says which probes it wants, the second gets them."""
    observed = Observed(now, ready or {}, primary)
    plan = decide(NAME, spec, status, observed, hub_revision=hub)
    if plan.probe_wanted and read_probes:
        probes = {}
        for rev in plan.probe_wanted:
            record = plan.by_name(rev)  # its identity: what the pods of that revision run
            probes[rev] = ProbeRead(error="connection refused") if rev in errors else ProbeRead(body=probe_of(record))
        observed = Observed(now, observed.ready, primary, probes)
        plan = decide(NAME, spec, status, observed, hub_revision=hub)
    return plan, observed


def apply(status: dict[str, Any], plan: Plan) -> dict[str, Any]:
    out = {**status, **plan.status_fields()}
    out["conditions"] = status_mod.merge_conditions(status.get("conditions"), [dict(plan.blocked)], "now")
    return out


def blocked(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "RolloutBlocked")


def states(plan: Plan) -> dict[str, str]:
    return {r["name"]: r["state"] for r in plan.revisions}


# ---------------------------------------------------------------- examples


def test_first_revision_is_r1_in_its_own_space_and_gets_its_fingerprint() -> None:
    plan, _ = step(spec_of(), {}, T0)
    assert (plan.current_revision, plan.query_vector_space, states(plan)) == ("r1", "r1", {"r1": "Serving"})
    assert plan.by_name("r1")["servedNames"] == ["bge", "bge@r1"]
    assert plan.rollout["phase"] == "Idle" and plan.blocked["status"] == "False"
    status = apply({}, plan)
    assert needs_observation(spec_of(), status)  # no fingerprint yet
    plan, _ = step(spec_of(), status, T0, ready={"r1": 1}, primary="r1")
    assert plan.by_name("r1")["fingerprint"] == "sha256:afloat32"
    assert not needs_observation(spec_of(), apply(status, plan))


def serving_r1(spec: EmbeddingDeploymentSpec | None = None) -> dict[str, Any]:
    plan, _ = step(spec or spec_of(), {}, T0, ready={"r1": 1}, primary="r1")
    return apply({}, plan)


def test_compatible_change_within_tolerance_is_gated_then_promoted() -> None:
    status = serving_r1()
    new = spec_of(dtype="bfloat16")
    plan, _ = step(new, status, T0, ready={"r1": 1}, primary="r1")
    assert states(plan) == {"r1": "Serving", "r2": "Candidate"} and plan.current_revision == "r1"
    assert plan.rollout["phase"] == "Gating" and [e.reason for e in plan.events] == ["RolloutStarted"]
    (_, candidate) = plan.runs
    assert (candidate.revision, candidate.vector_space, candidate.replicas, candidate.primary) == ("r2", UNGATED, 1,
                                                                                                   False)
    status = apply(status, plan)
    # The candidate's pod is ready: both probes are read and compared.
    plan, _ = step(new, status, T0 + timedelta(seconds=30), ready={"r1": 1, "r2": 1}, primary="r1")
    assert plan.current_revision == "r2" and plan.query_vector_space == "r1"
    assert states(plan) == {"r1": "Draining", "r2": "Serving"}
    gate = plan.by_name("r2")["gate"]
    assert gate["passed"] and 0.999 <= gate["minCosine"] < 1.0
    assert plan.by_name("r2")["fingerprint"] == "sha256:abfloat16" and plan.by_name("r1")["fingerprint"]
    assert [r.revision for r in plan.runs] == ["r2"]  # the candidate goes; the primary rolls to r2
    assert [e.reason for e in plan.events] == ["RevisionPromoted"]
    status = apply(status, plan)
    # The primary Deployment has rolled: r1 retires.
    plan, _ = step(new, status, T0 + timedelta(seconds=60), ready={"r2": 1}, primary="r2")
    assert states(plan) == {"r1": "Retired", "r2": "Serving"} and plan.rollout["phase"] == "Idle"


def test_compatible_change_of_weights_is_blocked_naming_the_drift() -> None:
    status = serving_r1()
    new = spec_of(source=SOURCES[1])
    status = apply(status, step(new, status, T0)[0])
    plan, _ = step(new, status, T0 + timedelta(seconds=5), ready={"r1": 1, "r2": 1}, primary="r1")
    assert plan.current_revision == "r1" and states(plan) == {"r1": "Serving", "r2": "Blocked"}
    assert plan.blocked["status"] == "True" and plan.blocked["reason"] == "DriftTooHigh"
    assert "probe min cosine" in plan.blocked["message"] and "minCosine 0.999" in plan.blocked["message"]
    assert [r.revision for r in plan.runs] == ["r1"]  # the candidate is removed, traffic stays
    assert [e.reason for e in plan.events] == ["RolloutBlocked"]
    # Going back to r1's identity clears it.
    status = apply(status, plan)
    plan, _ = step(spec_of(), status, T0 + timedelta(seconds=9), ready={"r1": 1}, primary="r1")
    assert plan.blocked["status"] == "False" and states(plan) == {"r1": "Serving", "r2": "Retired"}


def test_a_candidate_that_never_answers_times_out() -> None:
    status = serving_r1()
    new = spec_of(dtype="bfloat16", timeout=60)
    status = apply(status, step(new, status, T0)[0])
    plan, _ = step(new, status, T0 + timedelta(seconds=30), ready={"r1": 1, "r2": 1}, primary="r1",
                   errors=frozenset({"r2"}))
    assert plan.rollout["phase"] == "Gating" and "connection refused" in plan.rollout["message"]
    status = apply(status, plan)
    plan, _ = step(new, status, T0 + timedelta(seconds=61), ready={"r1": 1, "r2": 1}, primary="r1",
                   errors=frozenset({"r2"}))
    assert plan.blocked["reason"] == "GateTimeout" and "connection refused" in plan.blocked["message"]
    assert plan.current_revision == "r1"


def test_breaking_change_runs_side_by_side_until_query_revision_flips_it() -> None:
    status = serving_r1()
    new = spec_of(source=SOURCES[1], compatibility="breaking")
    plan, _ = step(new, status, T0, ready={"r1": 1}, primary="r1")
    assert states(plan) == {"r1": "Serving", "r2": "SideBySide"} and plan.query_vector_space == "r1"
    assert plan.by_name("r2")["vectorSpace"] == "r2" and plan.by_name("r2")["servedNames"] == ["bge@r2"]
    assert [(r.revision, r.vector_space, r.primary) for r in plan.runs] == [("r1", "r1", True), ("r2", "r2", False)]
    status = apply(status, plan)
    plan, _ = step(new, status, T0, ready={"r1": 1, "r2": 1}, primary="r1")
    assert plan.by_name("r2")["fingerprint"] == "sha256:bfloat32" and plan.current_revision == "r1"
    status = apply(status, plan)
    flip = spec_of(source=SOURCES[1], compatibility="breaking", query_revision="r2")
    # No ready r2 pod (say it restarted): flipping now would leave the bare name with no endpoint.
    plan, _ = step(flip, status, T0, ready={"r1": 1}, primary="r1")
    assert plan.current_revision == "r1" and "before flipping" in plan.rollout["message"]
    plan, _ = step(flip, status, T0, ready={"r1": 1, "r2": 1}, primary="r1")
    assert (plan.current_revision, plan.query_vector_space) == ("r2", "r2")
    assert states(plan) == {"r1": "Draining", "r2": "Serving"} and [e.reason for e in plan.events] == ["QueriesFlipped"]
    # The side Deployment answers the new space until the primary has rolled to r2.
    assert [(r.revision, r.primary) for r in plan.runs] == [("r2", True), ("r2", False)]
    status = apply(status, plan)
    plan, _ = step(flip, status, T0, ready={"r2": 2}, primary="r2")
    assert states(plan) == {"r1": "Retired", "r2": "Serving"} and [(r.revision, r.primary) for r in plan.runs] == [
        ("r2", True)]


def test_a_blocked_compatible_change_declared_breaking_runs_side_by_side() -> None:
    status = serving_r1()
    new = spec_of(source=SOURCES[1])
    status = apply(status, step(new, status, T0)[0])
    status = apply(status, step(new, status, T0, ready={"r1": 1, "r2": 1}, primary="r1")[0])
    assert blocked(status)["status"] == "True"
    plan, _ = step(spec_of(source=SOURCES[1], compatibility="breaking"), status, T0, primary="r1")
    assert states(plan)["r2"] == "SideBySide" and plan.by_name("r2")["vectorSpace"] == "r2"
    assert plan.blocked["status"] == "False"


def test_hub_names_the_revision_and_its_space() -> None:
    plan = decide(NAME, spec_of(dtype="bfloat16"), {}, Observed(T0), hub_revision="r3", hub_vector_space="r1")
    assert (plan.current_revision, plan.query_vector_space) == ("r3", "r1")
    status = apply({}, plan)
    plan = decide(NAME, spec_of(), status, Observed(T0), hub_revision="r4")
    assert states(plan) == {"r3": "Serving", "r4": "Candidate"}


def test_a_deployment_from_before_revisions_keeps_running_as_r1() -> None:
    """An existing deployment (no revisions in status) renders what it did, plus the revision labels."""
    spec = spec_of()
    plan, _ = step(spec, {"conditions": []}, T0)
    default = render(NAME, "ns", "u", spec)
    planned = render(NAME, "ns", "u", spec, runs=plan.runs,
                     query_vector_space=plan.query_vector_space)
    assert default == planned
    assert recorded_runs(spec, apply({}, plan)) == (plan.runs, "r1")


def test_render_of_a_side_by_side_revision() -> None:
    status = serving_r1()
    new = spec_of(source=SOURCES[1], dtype="bfloat16", compatibility="breaking")
    plan, _ = step(new, status, T0, ready={"r1": 1}, primary="r1")
    manifests = render(NAME, "ns", "u", new, runs=plan.runs,
                       query_vector_space=plan.query_vector_space)
    objects = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    assert set(objects) == {("ConfigMap", "emb-config"), ("Deployment", "emb"), ("Service", "emb"),
                            ("PodDisruptionBudget", "emb"), ("ConfigMap", "emb-r2-config"), ("Deployment", "emb-r2"),
                            ("Service", "emb-r2")}
    primary, side = objects[("Deployment", "emb")], objects[("Deployment", "emb-r2")]
    # The primary still runs r1's identity (status names it current), not the spec's.
    assert objects[("ConfigMap", "emb-config")]["data"]["EMBEDFLEET_MODEL"] == "/models/a"
    assert objects[("ConfigMap", "emb-config")]["data"]["EMBEDFLEET_DTYPE"] == "float32"
    side_env = objects[("ConfigMap", "emb-r2-config")]["data"]
    assert (side_env["EMBEDFLEET_MODEL"], side_env["EMBEDFLEET_DTYPE"]) == ("/models/b", "bfloat16")
    assert (side_env["EMBEDFLEET_REVISION"], side_env["EMBEDFLEET_VECTOR_SPACE"]) == ("r2", "r2")
    assert side["spec"]["replicas"] == 1
    pod_labels = side["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[naming.COMPONENT_LABEL] == "revision" and pod_labels[naming.REVISION_LABEL] == "r2"
    assert primary["spec"]["template"]["metadata"]["labels"][naming.VECTOR_SPACE_LABEL] == "r1"
    assert primary["spec"]["selector"]["matchLabels"] == {naming.INSTANCE_LABEL: NAME,
                                                          naming.COMPONENT_LABEL: "runtime"}
    main, per_revision = objects[("Service", "emb")], objects[("Service", "emb-r2")]
    assert main["spec"]["selector"] == {naming.INSTANCE_LABEL: NAME, naming.VECTOR_SPACE_LABEL: "r1"}
    assert main["metadata"]["annotations"][naming.MODEL_ANNOTATION] == "bge"
    assert per_revision["spec"]["selector"] == {naming.INSTANCE_LABEL: NAME, naming.REVISION_LABEL: "r2"}
    assert per_revision["metadata"]["annotations"][naming.MODEL_ANNOTATION] == "bge@r2"
    assert per_revision["metadata"]["annotations"][naming.VECTOR_SPACE_ANNOTATION] == "r2"


def test_rolled_revision_needs_every_pod_updated_and_ready() -> None:
    def deployment(replicas: int, updated: int, ready: int, generation: int = 2, observed: int = 2) -> dict:
        return {"metadata": {"generation": generation},
                "spec": {"replicas": 2, "template": {"metadata": {"labels": {naming.REVISION_LABEL: "r2"}}}},
                "status": {"observedGeneration": observed, "replicas": replicas, "updatedReplicas": updated,
                           "readyReplicas": ready}}

    assert rolled_revision(deployment(2, 2, 2)) == "r2"
    assert rolled_revision(deployment(3, 2, 2)) is None  # an old pod still terminating
    assert rolled_revision(deployment(2, 1, 2)) is None
    assert rolled_revision(deployment(2, 2, 2, observed=1)) is None
    assert rolled_revision(None) is None


# ---------------------------------------------------------------- properties

specs = st.builds(spec_of, source=st.sampled_from((SOURCES[0], *SOURCES)), dtype=st.sampled_from(DTYPES),
                  compatibility=st.sampled_from(("compatible", "breaking")),
                  query_revision=st.sampled_from((None, "r1", "r2", "r3", "r4")), timeout=st.sampled_from((60, 600)))
observations = st.fixed_dictionaries({
    "ready": st.dictionaries(st.sampled_from(("r1", "r2", "r3", "r4", "r5")), st.integers(0, 2), max_size=5),
    "primary": st.sampled_from((None, "r1", "r2", "r3", "r4", "current")),
    "errors": st.frozensets(st.sampled_from(("r1", "r2", "r3", "r4")), max_size=2),
    "advance": st.sampled_from((0, 5, 120)),
})
steps = st.lists(st.tuples(st.booleans(), specs, observations), min_size=1, max_size=12)


def run_steps(sequence: list[tuple[bool, EmbeddingDeploymentSpec, dict[str, Any]]], check: Any) -> None:
    spec, status, now = spec_of(), {}, T0
    for change, new_spec, obs in sequence:
        if change:
            spec = new_spec
        now += timedelta(seconds=obs["advance"])
        primary = status.get("currentRevision") if obs["primary"] == "current" else obs["primary"]
        plan, observed = step(spec, status, now, ready=obs["ready"], primary=primary, errors=obs["errors"])
        check(spec, status, plan, observed)
        status = apply(status, plan)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=steps)
def test_the_bare_name_never_maps_to_two_vector_spaces(sequence: list) -> None:
    def check(spec: Any, before: dict, plan: Plan, observed: Observed) -> None:
        current = plan.by_name(plan.current_revision)
        assert current is not None and current["state"] == "Serving"
        assert plan.query_vector_space == current["vectorSpace"] != UNGATED
        assert sum(r["state"] == "Serving" for r in plan.revisions) == 1
        # Every pod the main Service selects (its vector-space label) serves that space's vectors.
        for run in plan.runs:
            record = plan.by_name(run.revision)
            assert run.vector_space in (UNGATED, record["vectorSpace"])
            if run.vector_space == plan.query_vector_space:
                assert record["vectorSpace"] == plan.query_vector_space
        assert sum(r.primary for r in plan.runs) == 1 and plan.runs[0].revision == plan.current_revision
        # A revision in another space than the one it had never appears under the bare name.
        old_current = before.get("currentRevision")
        if old_current and plan.current_revision != old_current:
            old = next(r for r in before["revisions"] if r["name"] == old_current)
            if old["vectorSpace"] != plan.query_vector_space:
                assert any(e.reason == "QueriesFlipped" for e in plan.events)

    run_steps(sequence, check)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=steps)
def test_a_failed_gate_never_changes_the_current_revision(sequence: list) -> None:
    def check(spec: Any, before: dict, plan: Plan, observed: Observed) -> None:
        old_current = before.get("currentRevision")
        if old_current is None or plan.current_revision == old_current:
            return
        new = plan.by_name(plan.current_revision)
        old = next(r for r in before["revisions"] if r["name"] == old_current)
        # A change of current came from a passed gate (same space) or a flip the user asked for.
        passed = (new.get("gate") or {}).get("passed") is True and new["vectorSpace"] == old["vectorSpace"]
        flipped = spec.rollout.query_revision == new["name"]
        assert passed or flipped, (before, plan)
        assert not any(r["state"] == "Blocked" and r["name"] == plan.current_revision for r in plan.revisions)

    run_steps(sequence, check)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=steps)
def test_a_breaking_revision_is_current_only_once_query_revision_names_it(sequence: list) -> None:
    def check(spec: Any, before: dict, plan: Plan, observed: Observed) -> None:
        old_current = before.get("currentRevision")
        if old_current is None or plan.current_revision == old_current:
            return
        was = next((r for r in before["revisions"] if r["name"] == plan.current_revision), None)
        if was is not None and was["state"] == "SideBySide":
            assert spec.rollout.query_revision == plan.current_revision
        if spec.compatibility == "breaking" and was is not None and was["state"] != "Candidate":
            assert spec.rollout.query_revision == plan.current_revision

    run_steps(sequence, check)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=steps)
def test_deciding_on_its_own_output_changes_nothing(sequence: list) -> None:
    def check(spec: Any, before: dict, plan: Plan, observed: Observed) -> None:
        again = decide(NAME, spec, apply(before, plan), observed)
        assert again.status_fields() == plan.status_fields()
        assert again.blocked == plan.blocked and again.runs == plan.runs and again.events == []

    run_steps(sequence, check)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=steps, compatibility=st.sampled_from(("compatible", "breaking")))
def test_reverting_to_the_current_identity_clears_the_rollout(sequence: list, compatibility: str) -> None:
    def check(spec: Any, before: dict, plan: Plan, observed: Observed) -> None:
        status = apply(before, plan)
        current = plan.by_name(plan.current_revision)
        back = spec_of(source=current["source"], dtype=current["dtype"], compatibility=compatibility,
                       query_revision=spec.rollout.query_revision)
        assert identity(back)["source"] == current["source"]
        reverted = decide(NAME, back, status, observed)
        assert reverted.current_revision == plan.current_revision
        assert reverted.blocked["status"] == "False"
        assert not any(r["state"] in ("Candidate", "SideBySide", "Blocked") for r in reverted.revisions)
        assert {r.revision for r in reverted.runs} == {plan.current_revision}

    run_steps(sequence, check)


def test_a_hub_name_that_collides_with_what_serves_here_never_replaces_it() -> None:
    status = serving_r1()  # this spoke ran r1 = source a before it joined a hub
    plan = decide(NAME, spec_of(source=SOURCES[1]), status, Observed(T0), hub_revision="r1")
    assert plan.current_revision == "r1" and plan.by_name("r1")["source"] == SOURCES[0]
    assert states(plan) == {"r1": "Serving", "r2": "Candidate"}
