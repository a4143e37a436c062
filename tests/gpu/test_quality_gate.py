"""The FP8 quality gate: pure decisions, the calibration it judges on, then the gate run in process on tiny
models and on the embedded all-MiniLM-L6-v2 (CPU emulation)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from tokenizers import Tokenizer

from embedfleet.runtime.engines.fp8 import Fp8Linear
from embedfleet.runtime.engines.quality_gate import (
    CALIBRATION_FILE,
    FP8_MARGIN_FACTOR,
    Calibration,
    Fp8Rejected,
    calibration_batches,
    classify_gate,
    decide,
    degenerate_rows,
    embedding_gate,
    fp8_calibration,
    gate_fp8,
    load_calibration,
    ranking_preserved,
    rankings,
    required_min_cosine,
    rerank_gate,
    row_cosines,
)
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.engines.vocab_calibration import MIN_LENGTH, length_ladder, vocabulary_texts, whole_words
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir

finite = st.floats(-100, 100, allow_nan=False, allow_infinity=False, width=32)
thresholds = st.floats(-1.0, 1.0)
factors = st.floats(1.0, 100.0)


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


# -- the margin: the calibration minimum must leave room for the served tail ----------------------
@given(thresholds, factors)
def test_required_bound_lies_between_the_threshold_and_one(threshold, factor):
    required = required_min_cosine(threshold, factor)
    assert threshold <= required <= 1.0
    assert required == pytest.approx(1 - (1 - threshold) / factor, abs=1e-12)  # the allowed deviation / factor


@given(thresholds)
def test_no_margin_is_the_threshold_exactly(threshold):
    assert required_min_cosine(threshold, 1.0) == threshold
    assert required_min_cosine(1.0, FP8_MARGIN_FACTOR) == 1.0


@given(thresholds, thresholds, factors, factors)
def test_the_bound_rises_with_the_threshold_and_the_factor(t1, t2, f1, f2):
    (t1, t2), (f1, f2) = sorted((t1, t2)), sorted((f1, f2))
    assert required_min_cosine(t1, f1) <= required_min_cosine(t2, f1)
    assert required_min_cosine(t1, f1) <= required_min_cosine(t1, f2)


@pytest.mark.parametrize("factor", [0.5, 0.999, float("nan")])
def test_a_margin_factor_below_one_is_refused(factor):
    with pytest.raises(ValueError, match="must be >= 1"):
        required_min_cosine(0.99, factor)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, (6, 8), elements=finite), arrays(np.float32, (6, 8), elements=st.floats(-1, 1, width=32)),
       st.floats(0.9, 1.0), factors)
def test_the_margin_only_ever_refuses_more(ref, noise, threshold, factor):
    """With a margin the gate accepts a subset of what it accepts without, and it reports the same
    figure: the calibration minimum it judged, never the bound."""
    cand = ref + noise
    margin, plain = embedding_gate(ref, cand, threshold, margin_factor=factor), embedding_gate(ref, cand, threshold)
    assert plain.passed or not margin.passed
    assert margin.min_cosine == plain.min_cosine == pytest.approx(row_cosines(ref, cand).min())
    assert margin.passed is (margin.min_cosine >= margin.required)
    assert margin.required == required_min_cosine(threshold, factor) and plain.required == threshold


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-6, 0.5), st.floats(0.5, 1.0), factors)
def test_the_margin_is_proportional_to_the_allowed_deviation(deviation, threshold, factor):
    """One output at cosine 1 - deviation passes exactly when factor x deviation <= 1 - threshold."""
    assume(abs(deviation * factor - (1 - threshold)) > 1e-9)  # off the rounding edge
    angle = np.arccos(1 - deviation)
    ref, cand = np.array([[1.0, 0.0]]), np.array([[np.cos(angle), np.sin(angle)]])
    assert embedding_gate(ref, cand, threshold, margin_factor=factor).passed is (deviation * factor <= 1 - threshold)


def test_a_refusal_by_the_margin_says_so():
    ref, cand = np.array([[1.0, 0.0]]), np.array([[1.0, 0.12]])  # cosine 0.992877: above 0.99, below 0.993333
    result = embedding_gate(ref, cand, 0.99, margin_factor=1.5)
    assert not result.passed and embedding_gate(ref, cand, 0.99).passed
    assert "< 0.993333 (threshold 0.99 with margin factor 1.5" in result.reason
    assert "min cosine 0.992877" in result.summary() and "required 0.993333 with margin factor 1.5" in result.summary()


def test_the_margin_applies_to_embedders_only():
    """Rerankers are judged on order and classifiers on labels too; the factor was measured on embeddings."""
    cal = Calibration(["a", "b"], ["q"], [["d1", "d2"]])
    ref, cand = np.array([[2.0, 1.0], [0.0, 3.0]]), np.array([[2.0, 1.05], [0.0, 3.0]])
    assert decide("embed", ref, cand, cal, 0.99, 1.5).required == pytest.approx(0.993333, abs=1e-6)
    assert decide("classify", ref, cand, cal, 0.99, 1.5).required == 0.99
    assert decide("rerank", np.array([1.0, 0.0]), np.array([1.0, 0.1]), cal, 0.99, 1.5).required is None


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


# -- what the gate judges on: the fixed file plus the model's own vocabulary ------------------------
@given(st.integers(MIN_LENGTH, 10_000))
def test_length_ladder_spans_queries_to_the_maximum(max_length):
    ladder = length_ladder(max_length)
    assert ladder == sorted(ladder, reverse=True) and ladder.count(max_length) == 8
    assert MIN_LENGTH <= ladder[-1] < 2 * MIN_LENGTH  # down to short queries
    rungs = sorted(set(ladder), reverse=True)
    assert all(a // 2 == b for a, b in pairwise(rungs))  # every halving, none skipped


@pytest.fixture(scope="module")
def minilm_spec():
    return load_spec(default_model_dir())


def test_vocabulary_texts_are_rare_whole_words_up_to_the_maximum_length(minilm_spec):
    spec = minilm_spec
    texts = vocabulary_texts(spec.path / "tokenizer.json", spec.max_length)
    assert texts == vocabulary_texts(spec.path / "tokenizer.json", spec.max_length)  # the same every start
    tok = Tokenizer.from_file(str(spec.path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    words = whole_words(tok)
    assert len(words) == 2048 and all(w.isalpha() for w in words)
    ids = [tok.token_to_id(w) for w in words]
    assert all(tok.encode(w, add_special_tokens=False).ids == [i] for w, i in zip(words[:200], ids, strict=False))
    assert np.median(ids) > tok.get_vocab_size() / 3  # mostly the rare end of the vocabulary
    tok.enable_truncation(max_length=spec.max_length)
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    assert lengths.count(spec.max_length) >= 8 and min(lengths) <= 8  # long passages and short queries


def test_every_tokenizer_gets_its_own_vocabulary_texts(tiny, minilm_spec):
    """A byte-level BPE of 400 entries has few whole words: it still gets passages, from its own tokens."""
    spec = load_spec(tiny["llama-embed"])
    texts = vocabulary_texts(spec.path / "tokenizer.json", spec.max_length)
    assert len(texts) == len(length_ladder(spec.max_length)) and all(texts)
    assert texts != vocabulary_texts(minilm_spec.path / "tokenizer.json", spec.max_length)


def test_embedders_are_judged_on_the_fixed_file_and_vocabulary_passages(tiny):
    fixed = load_calibration()
    spec = load_spec(tiny["bert-embed"])
    cal = fp8_calibration(spec)
    assert cal.texts[:64] == fixed.texts and len(cal.texts) == 64 + len(length_ladder(spec.max_length))
    assert (cal.queries, cal.documents) == (fixed.queries, fixed.documents)
    for kind in ("bert-rerank", "bert-classify"):  # no label or ranking to keep in a run of unrelated words
        assert fp8_calibration(load_spec(tiny[kind])) == fixed


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 150), min_size=1, max_size=40), st.integers(1, 2000), st.integers(1, 16))
def test_calibration_batches_keep_order_and_the_token_budget(tiny, words, max_tokens, batch_size):
    spec = load_spec(tiny["bert-embed"])
    cal = Calibration([" ".join(["word"] * n) for n in words], [], [])
    batches = calibration_batches(spec, cal, batch_size=batch_size, max_tokens=max_tokens)
    one_by_one = [x for b in calibration_batches(spec, cal, batch_size=1) for x in b]
    assert [x for b in batches for x in b] == one_by_one
    for b in batches:
        assert len(b) <= batch_size and (len(b) == 1 or len(b) * max(len(x) for x in b) <= max_tokens)


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
        assert engine.fp8_gate.min_cosine >= engine.fp8_gate.required > 0.999


@pytest.mark.usefixtures("cpu_bf16")
def test_gate_forced_high_falls_back_to_bf16(tiny, caplog):
    engine = TorchEngine(load_spec(tiny["bert-embed"]), dtype="fp8", num_threads=2, fp8_min_cosine=1.0)
    assert not engine.fp8_gate.passed and engine.effective_dtype == "bfloat16"
    assert _count_fp8(engine) == 0  # the bf16 linears are back
    assert "falling back to bfloat16" in caplog.text and "refused" in caplog.text
    # and it serves what bf16 serves on the same modules (fp8 loads transformers' modules, padded on CPU; a
    # bf16 engine on the runtime's own modules runs packed there and rounds in another order)
    bf16 = TorchEngine(load_spec(tiny["bert-embed"]), dtype="bfloat16", num_threads=2, native=False)
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


@pytest.mark.usefixtures("cpu_bf16")
def test_minilm_gate_refuses_fp8_where_held_out_text_falls_below_and_accepts_where_it_holds(minilm_spec):
    """The embedded model, FP8 emulated (~30 s). On 4,000 held-out bench-corpus texts FP8's lowest cosine
    with bf16 is 0.98694 (docs/gpu.md, bench/fp8_gate.py): below 0.99, above 0.97. Judged on the fixed file
    alone without a margin, the gate accepted 0.99 (calibration minimum 0.99118); it must refuse it, and
    still accept 0.97."""
    engine = TorchEngine(minilm_spec, dtype="fp8", num_threads=2, fp8_min_cosine=0.99)
    refused = engine.fp8_gate
    assert refused is not None and not refused.passed and engine.effective_dtype == "bfloat16"
    assert refused.required == pytest.approx(required_min_cosine(0.99, FP8_MARGIN_FACTOR))
    assert refused.min_cosine < refused.required
    assert _count_fp8(engine) == 0
    accepted = gate_fp8(engine, minilm_spec, 0.97)  # the same engine, bf16 again after the refusal
    assert accepted.passed and _count_fp8(engine) > 0
    assert accepted.min_cosine == pytest.approx(refused.min_cosine, abs=1e-6)  # the same calibration, judged
    assert accepted.required == pytest.approx(0.98)
