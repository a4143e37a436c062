"""The FP8 quality gate: pure decisions, then the gate run on tiny models in process (CPU emulation)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from embedfleet.runtime.engines.fp8 import Fp8Linear
from embedfleet.runtime.engines.quality_gate import (
    CALIBRATION_FILE,
    Fp8Rejected,
    classify_gate,
    degenerate_rows,
    embedding_gate,
    load_calibration,
    ranking_preserved,
    rankings,
    rerank_gate,
    row_cosines,
)
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec

finite = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)


def test_calibration_set_is_shipped_and_varied():
    cal = load_calibration()
    assert CALIBRATION_FILE.is_file()
    assert len(cal.texts) == 64 and len(set(cal.texts)) == 64
    assert len(cal.pairs) == 32 and cal.groups == [4] * 8
    lengths = sorted(len(t) for t in cal.texts)
    assert lengths[0] <= 3 and lengths[-1] >= 400  # one-word inputs and long passages
    assert any(ord(c) > 0x3000 for t in cal.texts for c in t)  # CJK
    assert any("def " in t or "SELECT" in t for t in cal.texts)  # code


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, (6, 8), elements=finite))
@example(np.full((6, 8), 6e-45, dtype=np.float32))
def test_identical_embeddings_always_pass(ref):
    """Subnormal rows included: two identical degenerate rows agree like two zero rows."""
    result = embedding_gate(ref, ref.copy(), 0.999)
    assert result.passed, result


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, (6, 8), elements=finite), st.floats(0.01, 100))
@example(np.full((6, 8), 6e-45, dtype=np.float32), 0.125)
def test_rescaled_embeddings_pass_unless_a_row_crosses_into_degenerate(ref, factor):
    """A float32 rescale keeps each row's direction, except where it carries the row's norm across
    float32's smallest normal number: there the gate rightly sees a real vector turned (almost) zero,
    or the reverse (test_a_row_collapsing_to_zero_fails)."""
    cand = ref * np.float32(factor)
    assume((degenerate_rows(ref) == degenerate_rows(cand)).all())
    result = embedding_gate(ref, cand, 0.999)
    assert result.passed, result


def test_subnormal_rows_are_degenerate_and_agree_with_zero():
    """The counterexample hypothesis found: 6e-45 x 0.125 rounds to 0.0 in float32. Both rows are
    below float32's smallest normal norm, so both are degenerate: they agree, as two zero rows do."""
    ref = np.zeros((2, 8), dtype=np.float32)
    ref[0, 3] = 6e-45
    ref[1] = 1.0
    cand = ref * np.float32(0.125)
    assert cand[0].tolist() == [0.0] * 8
    assert degenerate_rows(ref).tolist() == [True, False]
    assert row_cosines(ref, cand) == pytest.approx([1.0, 1.0])
    assert embedding_gate(ref, cand, 0.999).passed


def test_a_row_collapsing_to_zero_fails():
    ref = np.ones((3, 8), dtype=np.float32)
    ref[1] *= np.float32(1e-30)  # tiny but normal: a real direction
    cand = ref.copy()
    cand[1] = 0.0
    result = embedding_gate(ref, cand, 0.999)
    assert not result.passed and "input 1 has cosine 0.000000" in result.reason


def test_one_bad_embedding_fails_the_gate_and_is_named():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(10, 16)).astype(np.float32)
    cand = ref + rng.normal(scale=1e-4, size=ref.shape).astype(np.float32)
    assert embedding_gate(ref, cand, 0.999).passed
    cand[7] = rng.normal(size=16)
    result = embedding_gate(ref, cand, 0.999)
    assert not result.passed and "input 7" in result.reason and result.min_cosine < 0.999
    assert embedding_gate(ref, cand, 0.999).min_cosine == pytest.approx(row_cosines(ref, cand).min())


def test_threshold_decides():
    ref = np.array([[1.0, 0.0], [0.0, 1.0]])
    cand = np.array([[1.0, 0.03], [0.0, 1.0]])  # cosine 0.99955
    assert embedding_gate(ref, cand, 0.999).passed
    assert not embedding_gate(ref, cand, 0.9999).passed


def test_nan_output_fails():
    ref = np.ones((2, 4))
    cand = ref.copy()
    cand[1, 2] = np.nan
    assert not embedding_gate(ref, cand, 0.5).passed


def test_zero_rows():
    cos = row_cosines(np.array([[0.0, 0.0], [1.0, 0.0]]), np.array([[0.0, 0.0], [0.0, 0.0]]))
    assert cos.tolist() == [1.0, 0.0]
    assert row_cosines(np.array([[1e-39, 0.0]]), np.array([[0.0, 1e-39]])).tolist() == [1.0]  # both degenerate


def test_rankings_per_query():
    assert rankings(np.array([0.1, 0.9, 0.5, 3.0, 2.0]), [3, 2]) == [[1, 2, 0], [0, 1]]


def test_reranker_gate_checks_order_not_scores():
    ref = np.array([2.0, 1.0, 0.5, -1.0, 0.3, 0.2, 0.1, 0.0])
    shifted = ref * 0.5 + 3  # different scores, same order: passes
    assert rerank_gate(ref, shifted, [4, 4], 0.999).passed
    swapped = ref.copy()
    swapped[5], swapped[6] = 0.1, 0.2
    result = rerank_gate(ref, swapped, [4, 4], 0.999)
    assert not result.passed and result.order_preserved is False
    assert "query 1" in result.reason


def test_reranker_ties_within_tolerance_may_swap():
    ref = np.array([1.0, 1.0005, 0.0])
    cand = np.array([1.0004, 1.0001, 0.0])
    assert ranking_preserved(ref, cand, [3], tie_tolerance=1e-3)[0]
    assert not ranking_preserved(ref, cand, [3], tie_tolerance=0.0)[0]


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, 12, elements=st.floats(-10, 10)), st.permutations(range(4)))
def test_reranker_gate_fails_whenever_a_clear_order_changes(scores, perm):
    ref = scores.copy()
    cand = scores.copy()
    cand[:4] = scores[:4][list(perm)]
    changed = any(ref[i] - ref[j] > 1e-3 and not cand[i] > cand[j] for i in range(4) for j in range(4))
    assert rerank_gate(ref, cand, [4, 4, 4], 0.999).passed is not changed


def test_classifier_gate_refuses_a_changed_label():
    ref = np.array([[2.0, 1.9, -1.0], [0.0, 3.0, 1.0]])
    assert classify_gate(ref, ref * 1.0001, 0.999).passed
    flipped = np.array([[1.9, 2.0, -1.0], [0.0, 3.0, 1.0]])  # cosine ~0.9986, and input 0's label flips
    result = classify_gate(ref, flipped, 0.99)
    assert not result.passed and "changes label 0 -> 1" in result.reason


# -- the gate on real (tiny, random) models, FP8 emulated on CPU -----------------------------
def _count_fp8(engine: TorchEngine) -> int:
    return sum(isinstance(m, Fp8Linear) for m in engine.model.modules())


@pytest.mark.usefixtures("cpu_bf16")
@pytest.mark.parametrize("kind", ["bert-embed", "llama-embed", "bert-rerank", "bert-classify"])
def test_fp8_engine_accepted_at_default_threshold(tiny, kind):
    engine = TorchEngine(load_spec(tiny[kind]), dtype="fp8", num_threads=2)
    assert engine.fp8_gate is not None and engine.fp8_gate.passed, engine.fp8_gate
    assert engine.effective_dtype == "fp8" and _count_fp8(engine) > 0
    if kind.endswith("embed"):
        assert engine.fp8_gate.min_cosine >= 0.999


@pytest.mark.usefixtures("cpu_bf16")
def test_gate_forced_high_falls_back_to_bf16(tiny, caplog):
    engine = TorchEngine(load_spec(tiny["bert-embed"]), dtype="fp8", num_threads=2, fp8_min_cosine=1.0)
    assert not engine.fp8_gate.passed and engine.effective_dtype == "bfloat16"
    assert _count_fp8(engine) == 0  # the bf16 linears are back
    assert "falling back to bfloat16" in caplog.text and "refused" in caplog.text
    # and it serves what bf16 serves
    bf16 = TorchEngine(load_spec(tiny["bert-embed"]), dtype="bfloat16", num_threads=2)
    batch = [[101, 2023, 2003, 102], [101, 7592, 102]]
    np.testing.assert_array_equal(engine.embed(batch), bf16.embed(batch))


@pytest.mark.usefixtures("cpu_bf16")
def test_gate_strict_refuses(tiny):
    with pytest.raises(Fp8Rejected, match="fp8-strict"):
        TorchEngine(load_spec(tiny["bert-embed"]), dtype="fp8", num_threads=2, fp8_min_cosine=1.0,
                    fp8_strict=True)


def test_calibration_is_tokenized_per_task(tiny):
    """Rerankers are gated on the 32 (query, document) pairs with segment ids; the others on the 64 texts."""
    from embedfleet.runtime.engines.quality_gate import PairInput, calibration_batches

    cal = load_calibration()
    pairs = [x for b in calibration_batches(load_spec(tiny["bert-rerank"]), cal) for x in b]
    texts = [x for b in calibration_batches(load_spec(tiny["bert-embed"]), cal) for x in b]
    assert len(pairs) == 32 and all(isinstance(p, PairInput) and p.type_ids and 1 in p.type_ids for p in pairs)
    assert len(texts) == 64 and all(isinstance(t, list) and 0 < len(t) <= 128 for t in texts)
