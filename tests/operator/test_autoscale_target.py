"""The autoscaler's in-flight target per replica: spec.autoscaling.inFlightPerReplica, else a borrowed
spec.runtime.maxBatchRequests (reported as deprecated), else 32; and where the user sees the deprecation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.operator.autoscale import from_spec
from embedfleet.operator.autoscale_target import (
    DEFAULT_IN_FLIGHT_PER_REPLICA,
    DEPRECATION_REASON,
    Target,
    deprecation_message,
    in_flight_target,
    of_parsed,
)
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.hub.autoscale import fleet_target

ROOT = Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "0f" * 32
BASE: dict[str, Any] = {"model": {"source": "hf://BAAI/bge-small-en-v1.5", "digest": DIGEST}}

counts = st.integers(1, 4096)
maybe = st.one_of(st.none(), counts)
#: Other autoscaling keys a spec may carry beside the two that matter (none of them changes the rule).
others = st.fixed_dictionaries({}, optional={"targetUtilization": st.sampled_from([0.5, 0.7, 1.0]),
                                             "minReplicas": st.integers(0, 3), "enabled": st.just(True)})


def spec_of(own: int | None, batch: int | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    auto = dict(extra or {})
    if own is not None:
        auto["inFlightPerReplica"] = own
    if auto:
        spec["autoscaling"] = auto
    if batch is not None:
        spec["runtime"] = {"maxBatchRequests": batch}
    return spec


@settings(max_examples=80, deadline=None)
@given(own=counts, batch=maybe, extra=others)
def test_the_new_field_wins_and_reports_nothing(own: int, batch: int | None, extra: dict[str, Any]) -> None:
    assert in_flight_target(spec_of(own, batch, extra)) == Target(own, "inFlightPerReplica")


@settings(max_examples=80, deadline=None)
@given(batch=counts.filter(lambda b: b != 32), extra=others)
def test_an_explicit_batch_is_borrowed_and_reported(batch: int, extra: dict[str, Any]) -> None:
    target = in_flight_target(spec_of(None, batch, extra))
    assert (target.per_replica, target.source) == (batch, "maxBatchRequests")
    assert target.deprecation == deprecation_message(batch)
    assert "spec.runtime.maxBatchRequests" in target.deprecation
    assert "spec.autoscaling.inFlightPerReplica" in target.deprecation and "deprecated" in target.deprecation


@settings(max_examples=40, deadline=None)
@given(extra=others, stored_default=st.booleans())
def test_neither_gives_32_and_no_deprecation(extra: dict[str, Any], stored_default: bool) -> None:
    """Unset, or the 32 the API server's schema default stores in every object: the same target as before,
    and nothing to report (a user's own 32 gives the very same number)."""
    target = in_flight_target(spec_of(None, 32 if stored_default else None, extra))
    assert target == Target(DEFAULT_IN_FLIGHT_PER_REPLICA, "default") and target.per_replica == 32


def test_nothing_at_all_and_odd_shapes_fall_back_to_the_default() -> None:
    for spec in (None, {}, {"runtime": None, "autoscaling": None}, {"runtime": {}, "autoscaling": {}}):
        assert in_flight_target(spec) == Target(32, "default")


def test_with_autoscaling_off_the_number_is_kept_but_nothing_is_reported() -> None:
    target = in_flight_target(spec_of(None, 64, {"enabled": False}))
    assert target == Target(64, "maxBatchRequests")


@settings(max_examples=60, deadline=None)
@given(own=maybe, batch=maybe, extra=others)
def test_a_parsed_spec_decides_as_the_stored_one(own: int | None, batch: int | None, extra: dict[str, Any]) -> None:
    """The hub and the Accepted condition read a parsed spec: only what its source named counts as set,
    never the model's defaults."""
    raw = spec_of(own, batch, extra)
    assert of_parsed(EmbeddingDeploymentSpec.model_validate(raw)) == in_flight_target(raw)


def test_the_autoscalers_config_takes_the_chosen_number() -> None:
    assert from_spec({"inFlightPerReplica": 8}).in_flight_per_replica == 8  # read from spec.autoscaling
    assert from_spec({"inFlightPerReplica": 8}, 16).in_flight_per_replica == 16  # the caller's choice wins
    assert from_spec({}).in_flight_per_replica == 32
    borrowed = spec_of(None, 64, {"targetUtilization": 0.5})
    config = from_spec(borrowed["autoscaling"], in_flight_target(borrowed).per_replica)
    assert (config.in_flight_per_replica, config.target_per_replica) == (64, 32.0)
    with pytest.raises(ValueError, match=r"inFlightPerReplica must be >= 1"):
        from_spec({}, 0)


@pytest.mark.parametrize(
    ("own", "batch", "inflight", "want"),
    [
        (None, None, 100.0, 5),  # 100 / (32 x 0.7) = 4.5
        (None, 64, 100.0, 3),  # borrowed: 100 / (64 x 0.7) = 2.2
        (10, 64, 100.0, 10),  # own: 100 / (10 x 0.7) = 14.3, capped at maxReplicas
        (20, None, 100.0, 8),  # 100 / 14 = 7.1
    ],
)
def test_the_hub_uses_the_same_target(own: int | None, batch: int | None, inflight: float, want: int) -> None:
    spec = EmbeddingDeploymentSpec.model_validate(spec_of(own, batch, {"maxReplicas": 10}))
    assert fleet_target(spec, inflight, None) == want


def _shipped() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "e2e" / "embedding-kind.yaml"]:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "EmbeddingDeployment":
                found.append((f"{path.relative_to(ROOT)}:{doc['metadata']['name']}", doc["spec"]))
    return found


@pytest.mark.parametrize(("where", "spec"), _shipped(), ids=[w for w, _ in _shipped()])
def test_shipped_examples_name_their_own_target(where: str, spec: dict[str, Any]) -> None:
    """None raises the deprecation; one that names the runtime's batch names the autoscaler's own target too."""
    target = in_flight_target(spec)
    assert target.deprecation is None, where
    if "maxBatchRequests" in (spec.get("runtime") or {}) and (spec.get("autoscaling") or {}).get("enabled", True):
        assert target.source == "inFlightPerReplica", f"{where}: set spec.autoscaling.inFlightPerReplica"


# ---------------------------------------------------------------- what the user sees


def _accepted(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in conditions if c["type"] == "Accepted")


def test_accepted_names_the_deprecation_and_one_event_is_emitted(monkeypatch: pytest.MonkeyPatch) -> None:
    from embedfleet.operator.handlers import embedding

    warned: list[tuple[str, str]] = []
    monkeypatch.setattr(embedding.kopf, "warn", lambda obj, *, reason, message: warned.append((reason, message)))
    body = {"metadata": {"name": "bge", "namespace": "ns"}}

    borrowed = EmbeddingDeploymentSpec.model_validate(spec_of(None, 64))
    cond = embedding.accepted_condition(borrowed, 3)
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("True", DEPRECATION_REASON, 3)
    assert cond["message"] == "spec accepted; " + deprecation_message(64)

    # The write that first carries it: one Warning Event with the sentence alone.
    embedding.announce_deprecation(body, {"conditions": [embedding.accepted_condition(
        EmbeddingDeploymentSpec.model_validate(BASE), 2)]}, {"conditions": [cond]})
    assert warned == [(DEPRECATION_REASON, deprecation_message(64))]
    # A later write of the same condition (a new generation, another condition moving): no second Event.
    embedding.announce_deprecation(body, {"conditions": [cond]}, {"conditions": [{**cond, "observedGeneration": 4}]})
    embedding.announce_deprecation(body, {"conditions": [cond]}, {"replicas": {"ready": 1}})
    assert len(warned) == 1

    fixed = EmbeddingDeploymentSpec.model_validate(spec_of(16, 64))
    ok = embedding.accepted_condition(fixed, 5)
    assert (ok["reason"], ok["message"]) == ("Valid", "spec accepted")
    embedding.announce_deprecation(body, {"conditions": [cond]}, {"conditions": [ok]})
    assert len(warned) == 1
