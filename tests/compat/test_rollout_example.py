"""examples/rollout.yaml is what README's "Changing models safely" tells users to apply: it must pass the
operator's own checks, and its rollout fields must mean what its comments say."""

from __future__ import annotations

from pathlib import Path

import yaml

from embedfleet.operator import platform
from embedfleet.operator.validate import check

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rollout.yaml"


def test_the_rollout_example_is_accepted_and_gated_at_the_fp8_bar() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    parsed, problems = check(doc["metadata"]["name"], doc["spec"], platform.load())
    assert problems == [] and parsed is not None
    assert parsed.compatibility == "compatible" and parsed.rollout.min_cosine == 0.999
    assert [w.name for w in parsed.rollout.waves] == ["canary", "rest"]
    assert parsed.rollout.waves[0].regions == ["eu-west-1"]


def test_a_query_revision_that_is_not_a_revision_name_is_refused() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["rollout"]["queryRevision"] = "latest"
    parsed, problems = check(doc["metadata"]["name"], doc["spec"], platform.load())
    assert parsed is None and any("queryRevision" in p for p in problems)
