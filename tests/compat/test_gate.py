"""The drift gate (embedfleet.compat.gate) and the shared names: pure, so checked with hypothesis."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.compat.gate import ProbeOutputs, compare, order_swaps, row_cosines
from embedfleet.compat.identity import identity_hash
from embedfleet.compat.names import revision_number, split_model, with_revision
from embedfleet.compat.probe_set import load
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec

seeds = st.integers(min_value=0, max_value=2**32 - 1)


def vectors(seed: int, rows: int = 24, dim: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, dim))


@given(seeds, st.floats(min_value=0.1, max_value=10))
def test_the_same_vectors_pass_at_any_scale(seed: int, scale: float) -> None:
    """A revision whose vectors differ only in length (normalisation off vs on) serves the same index."""
    old = vectors(seed)
    result = compare(ProbeOutputs.of("embed", old), ProbeOutputs.of("embed", old * scale), 0.999)
    assert result.passed and result.order_kept and result.min_cosine == pytest.approx(1.0)


@given(seeds)
def test_unrelated_weights_are_blocked_and_the_message_names_the_figure(seed: int) -> None:
    result = compare(ProbeOutputs.of("embed", vectors(seed)), ProbeOutputs.of("embed", vectors(seed + 1)), 0.999)
    assert not result.passed
    assert result.min_cosine is not None and result.min_cosine < 0.999
    assert f"{result.min_cosine:.6f}" in result.message and "minCosine 0.999" in result.message


@given(seeds, st.floats(min_value=1e-7, max_value=1e-5))
def test_noise_far_below_the_bar_passes(seed: int, noise: float) -> None:
    old = vectors(seed)
    new = old + noise * np.random.default_rng(seed + 7).normal(size=old.shape)
    assert compare(ProbeOutputs.of("embed", old), ProbeOutputs.of("embed", new), 0.999).passed


@given(seeds)
@settings(max_examples=50)
def test_a_rotation_keeps_cosines_per_text_but_not_a_different_order(seed: int) -> None:
    """Swapping two texts' vectors keeps every vector's length but moves them: cosine catches it."""
    old = vectors(seed)
    new = old.copy()
    new[[0, 1]] = new[[1, 0]]
    result = compare(ProbeOutputs.of("embed", old), ProbeOutputs.of("embed", new), 0.999)
    assert not result.passed


def test_order_swaps_counts_only_clear_inversions() -> None:
    assert order_swaps(np.array([0.9, 0.5, 0.1]), np.array([0.8, 0.6, 0.2]), 0.01) == 0
    assert order_swaps(np.array([0.9, 0.5, 0.1]), np.array([0.5, 0.9, 0.1]), 0.01) == 1
    assert order_swaps(np.array([0.5, 0.501]), np.array([0.501, 0.5]), 0.01) == 0  # a near-tie may swap


def test_scores_gate_on_top1_and_order_not_on_cosine() -> None:
    old = np.array([[4.0, 1.0, -2.0], [0.1, 0.7, 0.2]])
    shifted = old * 1.5 + 3  # logits move, the ranking a user sees does not
    assert compare(ProbeOutputs.of("rerank", old), ProbeOutputs.of("rerank", shifted)).passed
    flipped = old.copy()
    flipped[0] = [1.0, 4.0, -2.0]
    result = compare(ProbeOutputs.of("rerank", old), ProbeOutputs.of("rerank", flipped))
    assert not result.passed and "top-1 changed on probe row(s) [0]" in result.message


def test_incomparable_outputs_are_refused_with_a_reason() -> None:
    a = vectors(1)
    assert "task changed" in compare(ProbeOutputs.of("embed", a), ProbeOutputs.of("classify", a)).message
    assert "shape changed" in compare(ProbeOutputs.of("embed", a), ProbeOutputs.of("embed", a[:, :8])).message
    v1, v2 = ProbeOutputs.of("embed", a, "probe-v1"), ProbeOutputs.of("embed", a, "probe-v2")
    assert "probe sets differ" in compare(v1, v2).message


@given(seeds)
def test_row_cosines_are_bounded(seed: int) -> None:
    cos = row_cosines(vectors(seed), vectors(seed + 3))
    assert np.all(cos <= 1 + 1e-9) and np.all(cos >= -1 - 1e-9)


@given(st.text(min_size=1, max_size=40).filter(lambda s: "@" not in s), st.integers(min_value=1, max_value=10**6))
def test_revision_names_round_trip(base: str, number: int) -> None:
    assert split_model(with_revision(base, f"r{number}")) == (base, f"r{number}")
    assert revision_number(f"r{number}") == number


def test_names_that_only_look_like_revisions_stay_whole() -> None:
    assert split_model("team@prod") == ("team@prod", None)
    assert split_model("m@r0") == ("m@r0", None)
    with pytest.raises(ValueError, match="not a revision name"):
        revision_number("x1")


def test_identity_changes_with_what_changes_vectors_only() -> None:
    base = {"model": {"source": "file:///models/a"}}
    spec = EmbeddingDeploymentSpec.model_validate(base)
    same = EmbeddingDeploymentSpec.model_validate({**base, "replicas": 7, "runtime": {"maxBatchTokens": 4096}})
    dtype = EmbeddingDeploymentSpec.model_validate({**base, "runtime": {"dtype": "bfloat16"}})
    weights = EmbeddingDeploymentSpec.model_validate({"model": {"source": "file:///models/b"}})
    assert identity_hash(spec) == identity_hash(same)
    assert len({identity_hash(spec), identity_hash(dtype), identity_hash(weights)}) == 3


def test_the_shipped_probe_set_is_well_formed() -> None:
    probe = load()
    assert probe.version and len(probe.texts) >= 16 and len(set(probe.texts)) == len(probe.texts)
    assert probe.rerank and all(len(r.documents) >= 3 for r in probe.rerank)
    assert len(probe.pairs()) == sum(len(r.documents) for r in probe.rerank)
