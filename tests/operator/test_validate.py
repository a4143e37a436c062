"""Semantic validation: what the schema cannot say, each as one sentence naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.operator.validate import KNOWN_MODEL_MAX_TOKENS, check, check_model_cache, source_problems

DIGEST = "sha256:" + "0f" * 32
GOOD: dict[str, Any] = {"model": {"source": "hf://BAAI/bge-small-en-v1.5", "digest": DIGEST}}


def with_(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        node = spec
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return spec


def test_good_spec_passes() -> None:
    spec, problems = check("bge", GOOD)
    assert problems == [] and spec is not None and spec.runtime.max_batch_requests is None


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (
            with_(autoscaling__minReplicas=5, autoscaling__maxReplicas=2),
            "minReplicas (5) is greater than maxReplicas (2)",
        ),
        (with_(autoscaling__panicWindowSeconds=90), "panicWindowSeconds"),
        (with_(runtime__maxBatchTokens=256), "maxBatchTokens (256) is smaller than the longest input (512"),
        (with_(model__maxInputTokens=8192, runtime__maxBatchTokens=4096), "maxBatchTokens (4096)"),
        (
            with_(runtime__maxInputTokens=1024),
            "maxInputTokens (1024) exceeds the model's maximum length (512)",
        ),
        (with_(runtime__gpu={"count": 1, "type": "nvidia-rtx-9090"}), "unknown GPU type 'nvidia-rtx-9090'"),
        (with_(runtime__gpu={"count": 0, "type": "nvidia-l4"}), "gpu.count is 0"),
        (with_(runtime__engine="trtllm"), "trtllm needs a GPU"),
        (with_(runtime__engines=2), "spec.runtime.engines (2) needs split serving"),
        (with_(runtime__engines=2, runtime__fronts=0), "set spec.runtime.fronts to 1 or more"),
        (with_(runtime__engines=9, runtime__fronts=2), "spec.runtime.engines: Input should be less"),
        (with_(runtime__dtype="fp8"), "fp8 needs a GPU"),
        (with_(runtime__dtype="int8", runtime__gpu__count=1), "int8 is CPU only"),
        (with_(runtime__dtype="int8", runtime__engine="trtllm", runtime__gpu__count=1), "int8 is CPU only"),
        (with_(model__source="hf://a/b/c"), "is not hf://<org>/<name>"),
        (with_(model__source="s3://bucket/key"), "s3:// and gs:// sources are not supported"),
        (with_(model__source="gs://bucket/key"), "publish the weights over https"),
        (with_(model__source="https://:80/x"), "has no host"),
        (with_(model__source="file://host/x"), "file:///<absolute path>"),
        (with_(model__source="pvc://Bad_Claim/x"), "PersistentVolumeClaim"),
        (with_(model__digest=None), "spec.model.digest is required"),
        (with_(cache__requireCachedNode=True), "requireCachedNode needs spec.cache.prePull"),
        (with_(model__source="pvc://claim/models", cache__prePull=True), "not pre-pulled"),
        (
            with_(runtime__resources={"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}),
            "exceeds its limit cpu=2",
        ),
        (with_(cache__nodePools=[{"name": "a"}, {"name": "a"}]), "pool names must be unique"),
        (with_(autoscaling__enabled=False, autoscaling__minReplicas=0), "spec.replicas"),
        (
            with_(runtime__maxBatchRequests="many"),
            "spec.runtime.maxBatchRequests: Input should be a valid integer",
        ),
        (with_(runtime__unknownKnob=1), "spec.runtime.unknownKnob: Extra inputs are not permitted"),
        (with_(autoscaling__inFlightPerReplica=0), "spec.autoscaling.inFlightPerReplica: Input should be greater"),
        (with_(autoscaling__inFlightPerReplica=5000), "spec.autoscaling.inFlightPerReplica: Input should be less"),
        (
            with_(runtime__apiKeySecret={"name": "one", "key": "k"}, runtime__apiKeysSecret={"name": "t", "key": "k"}),
            "spec.runtime: apiKeySecret and apiKeysSecret are mutually exclusive",
        ),
    ],
)
def test_problems_are_reported_by_field(spec: dict[str, Any], needle: str) -> None:
    parsed, problems = check("bge", spec)
    assert parsed is None
    assert any(needle in p for p in problems), problems


def test_in_flight_per_replica_is_accepted_beside_the_runtime_batch() -> None:
    spec, problems = check("bge", with_(autoscaling__inFlightPerReplica=16, runtime__maxBatchRequests=64))
    assert problems == [] and spec is not None
    assert (spec.autoscaling.in_flight_per_replica, spec.runtime.max_batch_requests) == (16, 64)
    assert check("bge", GOOD)[0].autoscaling.in_flight_per_replica is None  # type: ignore[union-attr]


def test_either_api_key_reference_alone_is_fine() -> None:
    for field in ("apiKeySecret", "apiKeysSecret"):
        spec, problems = check("bge", with_(**{f"runtime__{field}": {"name": "s", "key": "k"}}))
        assert problems == [] and spec is not None, field
    assert spec is not None and spec.runtime.api_keys_secret is not None and spec.runtime.api_key_secret is None


def test_names_must_leave_room_for_derived_objects() -> None:
    assert check("x" * 46, GOOD)[1]
    assert check("9lives", GOOD)[1]
    assert check("a" * 45, GOOD)[1] == []


def test_all_problems_are_listed_at_once() -> None:
    _, problems = check(
        "bge",
        with_(
            autoscaling__minReplicas=9, autoscaling__maxReplicas=1, runtime__gpu={"count": 1, "type": "tpu"}
        ),
    )
    assert len(problems) == 2


def test_model_cache_needs_a_digest() -> None:
    assert check_model_cache("c", {"model": {"source": "https://h/w.tar"}})[1]
    spec, problems = check_model_cache("c", {"model": {"source": "https://h/w.tar", "digest": DIGEST}})
    assert problems == [] and spec is not None


@pytest.mark.parametrize(
    "source",
    [
        "hf://org/name",
        "hf://gpt2",
        "http://127.0.0.1:8000/w.tar",
        "https://h.example/m/",
        "file:///models/x",
        "pvc://models/minilm",
    ],
)
def test_well_formed_sources(source: str) -> None:
    assert source_problems(source) == []


@settings(max_examples=80, deadline=None)
@given(lo=st.integers(0, 200), hi=st.integers(1, 200))
def test_min_greater_than_max_is_always_flagged(lo: int, hi: int) -> None:
    _, problems = check("bge", with_(autoscaling__minReplicas=lo, autoscaling__maxReplicas=hi))
    assert any("greater than maxReplicas" in p for p in problems) == (lo > hi)


@settings(max_examples=80, deadline=None)
@given(model=st.sampled_from(sorted(KNOWN_MODEL_MAX_TOKENS)), tokens=st.integers(1, 65536))
def test_batch_must_hold_one_full_length_input(model: str, tokens: int) -> None:
    org, name = model.split("/")
    _, problems = check("m", with_(model__source=f"hf://{org}/{name}", runtime__maxBatchTokens=tokens))
    flagged = any("maxBatchTokens" in p for p in problems)
    assert flagged == (tokens < KNOWN_MODEL_MAX_TOKENS[model])


def test_int8_on_cpu_is_accepted_and_reaches_the_runtime() -> None:
    from embedfleet.operator.render.config import runtime_env

    cpu = with_(runtime__dtype="int8")
    cpu["runtime"].pop("gpu", None)
    spec, problems = check("bge", cpu)
    assert problems == [] and spec is not None and spec.runtime.dtype == "int8"
    assert runtime_env("bge", spec)["EMBEDFLEET_DTYPE"] == "int8"


def test_unset_batching_is_the_runtimes_own() -> None:
    """Unset maxBatchTokens: on CPU the runtime's default is checked against the longest input; on a GPU the
    runtime sizes the budget itself, so nothing is refused here."""
    from embedfleet.operator.validate import RUNTIME_CPU_MAX_BATCH_TOKENS
    from embedfleet.runtime.settings import RuntimeSettings

    assert RUNTIME_CPU_MAX_BATCH_TOKENS == RuntimeSettings.model_fields["max_batch_tokens"].default
    _, problems = check("m", with_(model__maxInputTokens=32768, runtime__maxInputTokens=32768))
    assert any("maxBatchTokens (16384, the runtime's CPU default)" in p for p in problems), problems
    _, problems = check("m", with_(model__maxInputTokens=32768, runtime__maxInputTokens=32768,
                                   runtime__gpu={"count": 1, "type": "nvidia-h100"}))
    assert not any("maxBatchTokens" in p for p in problems), problems
