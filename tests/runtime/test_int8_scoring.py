"""`--dtype int8` for rerankers and classifiers: the scoring gate's pure measures (Spearman at the reference's
resolution, top-1 agreement, label agreement, probability difference) and real OpenVINO/NNCF builds of tiny
models. A reranker int8 keeps is served by a real server (/v1/rerank from the int8 engine, the gate's figures
on /v1/models); one int8 damages refuses the start with the figure that refused it, or serves float32. The
held-out judgement, its margin and the re-judgement of cached builds: tests/runtime/test_int8_scoring_gate.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.engines import int8_scoring, int8_scoring_gate
from embedfleet.runtime.engines.int8_cpu import Int8Rejected, build_int8_engine
from embedfleet.runtime.engines.int8_scoring import Int8ScoringEngine, build_int8_scoring_engine
from embedfleet.runtime.engines.int8_scoring_gate import (
    judge,
    measure_classify,
    measure_rerank,
    rerank_sets,
    softmax,
    spearman,
)
from embedfleet.runtime.engines.quality_gate import PairInput, calibration_batches, run_calibration
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from tests.tiny_models import bert_reranker, build_all

pytest.importorskip("openvino")
pytest.importorskip("nncf")

THREADS = 2
scores = st.lists(st.floats(-50, 50, allow_nan=False), min_size=2, max_size=12)


# -- pure measures -------------------------------------------------------------------------------------------
@given(scores)
def test_spearman_of_a_list_with_itself_or_any_increasing_map_is_one(x: list[float]) -> None:
    a = np.array(x)
    assert spearman(a, a) == pytest.approx(1.0)
    assert spearman(a, 2 * a) == pytest.approx(1.0)  # rank correlation: the scale is irrelevant (doubling is exact)


@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=2, max_size=12, unique=True))
def test_a_reversed_order_is_minus_one_and_any_order_is_within_bounds(x: list[float]) -> None:
    a = np.array(x)
    assert spearman(a, -a) == pytest.approx(-1.0)
    rng = np.random.default_rng(len(x))
    assert -1.0 <= spearman(a, rng.permutation(a)) <= 1.0


def test_spearman_matches_the_textbook_formula_and_steps() -> None:
    ref = np.array([4.0, 3.0, 2.0, 1.0])
    assert spearman(ref, np.array([4.0, 3.0, 1.0, 2.0])) == pytest.approx(0.8)  # one neighbour swap of 4
    assert spearman(np.arange(6.0), np.array([0, 1, 2, 3, 5, 4.0])) == pytest.approx(1 - 6 * 2 / (6 * 35))


def test_swaps_within_the_resolution_cost_nothing_and_beyond_it_count() -> None:
    ref = np.array([1.0, 1.001, 5.0, 9.0])
    swapped = np.array([1.001, 1.0, 5.0, 9.0])
    assert spearman(ref, swapped, tolerance=0.0) < 1.0
    assert spearman(ref, swapped, tolerance=0.01) == pytest.approx(1.0)
    assert spearman(ref, np.array([1.0, 1.001, 9.0, 5.0]), tolerance=0.01) < 0.95  # 5 and 9 are apart


def test_degenerate_lists() -> None:
    flat = np.ones(4)
    assert spearman(flat, flat) == 1.0  # neither orders anything
    assert spearman(flat, np.arange(4.0)) == 1.0  # the reference states no order for the candidate to break
    assert spearman(np.arange(4.0), flat) == 0.0  # the candidate loses the reference's order
    assert spearman(np.arange(4.0), np.array([0, 1, np.nan, 3])) == 0.0
    with pytest.raises(ValueError):
        spearman(np.arange(3.0), np.arange(4.0))


def test_rerank_figures_and_verdicts() -> None:
    ref = np.array([3.0, 2.0, 1.0, 0.0, 10.0, 0.0, 5.0])
    groups = [4, 3]
    same = measure_rerank(ref, ref + 0.5, groups)
    assert same["min_spearman"] == pytest.approx(1.0) and same["top1_agreement"] == 1.0
    assert judge(same).passed
    flipped = ref.copy()
    flipped[4:] = [0.0, 10.0, 5.0]  # the second query's best passage falls to last
    bad = measure_rerank(ref, flipped, groups)
    assert bad["worst_query"] == 1 and bad["top1_agreement"] == 0.5
    verdict = judge(bad)
    assert not verdict.passed and "judged query 1" in verdict.reason
    assert not judge(measure_rerank(ref, ref * np.nan, groups)).passed
    with pytest.raises(ValueError):
        measure_rerank(ref, ref, [4, 4])


@given(st.integers(0, 2**31 - 1))
@settings(max_examples=30)
def test_classify_verdict_follows_labels_and_probabilities(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(20, 3)) * 4
    assert judge(measure_classify(logits, logits)).passed
    moved = logits.copy()
    i = int(rng.integers(20))
    moved[i, np.argmin(logits[i])] = logits[i].max() + 5  # its least likely label becomes the most likely
    figures = measure_classify(logits, moved)
    assert figures["label_agreement"] < 1.0 and figures["max_prob_diff"] > 0.05
    assert not judge(figures).passed


def test_rerank_sets_are_deterministic_and_hold_long_and_degenerate_inputs() -> None:
    one, two = rerank_sets(), rerank_sets()
    assert one == two
    assert len(one.calibrate.queries) == 4 + int8_scoring_gate.EXTRA_GROUPS
    assert len(one.judge.queries) >= 2 + int8_scoring_gate.EXTRA_GROUPS  # the odd file groups, less any dropped
    for side in (one.calibrate, one.judge):
        passages = [d for docs in side.documents for d in docs]
        assert any(len(p.split()) >= 200 for p in passages), "passages near the token limit"
        assert any(p.strip() in ("a", "?", "i", "!") or len(set(p.split())) <= 2 for p in passages), "degenerate"
        assert any(len(set(q.split())) <= 2 and len(q.split()) >= 50 for q in side.queries), "degenerate queries"


# -- real builds ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    # judged out of sample (bench/results/int8-scoring-margin-cpu.jsonl): initializer range 0.2, seed 1 int8
    # keeps (min Spearman 0.943 over the judged queries, top-1 0.971); range 0.1, seed 0 it damages (0.657)
    out = {"kept": bert_reranker(root / "rerank-kept", seed=1, initializer_range=0.2),
           "damaged": bert_reranker(root / "rerank-damaged")}
    out["classify"] = build_all(root)["bert-classify"]
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


def test_a_reranker_int8_keeps_is_served_int8_and_scores_like_float32(models: dict[str, Path], cache: Path) -> None:
    spec = load_spec(models["kept"])
    engine = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "kept")
    assert isinstance(engine, Int8ScoringEngine) and engine.effective_dtype == "int8"
    gate = engine.int8_gate
    assert gate is not None and gate.passed and gate.measured_on in ("judge", "probe"), gate
    assert gate.min_spearman >= int8_scoring_gate.MIN_SPEARMAN
    judged = rerank_sets().judge
    batches = calibration_batches(spec, judged)
    fp32 = TorchEngine(spec, dtype="float32", num_threads=THREADS)
    ref, got = run_calibration(fp32.classify, batches), run_calibration(engine.classify, batches)
    assert got.shape == ref.shape == (sum(judged.groups), 1)
    assert np.corrcoef(ref[:, 0], got[:, 0])[0, 1] > 0.98
    with pytest.raises(Exception, match="serves rerank only"):
        engine.embed([[101, 102]])


def test_a_reranker_int8_damages_is_refused_or_served_float32(models: dict[str, Path], cache: Path) -> None:
    spec = load_spec(models["damaged"])
    with pytest.raises(Int8Rejected, match=r"int8 refused for rerank .* min Spearman .* judged query \d+"):
        build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "damaged")
    fallback = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "damaged", strict=False)
    assert isinstance(fallback, TorchEngine) and fallback.effective_dtype == "float32"
    assert fallback.int8_gate is not None and not fallback.int8_gate.passed
    assert fallback.int8_gate.min_spearman < int8_scoring_gate.MIN_SPEARMAN


def test_the_embedder_build_points_a_reranker_to_the_scoring_gate(models: dict[str, Path], cache: Path) -> None:
    with pytest.raises(Int8Rejected, match="judged on scores"):
        build_int8_engine(load_spec(models["kept"]), num_threads=THREADS, cache_root=cache / "wrong")
    assert not (cache / "wrong").exists()


def test_a_classifier_keeps_its_labels(models: dict[str, Path], cache: Path) -> None:
    spec = load_spec(models["classify"])
    engine = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "classify")
    assert isinstance(engine, Int8ScoringEngine)
    gate = engine.int8_gate
    assert gate.passed and gate.label_agreement >= int8_scoring_gate.MIN_LABEL_AGREEMENT
    assert gate.max_prob_diff <= int8_scoring_gate.MAX_PROB_DIFF
    batch = [[101, 7592, 2088, 102], [101, 2023, 2003, 1037, 3231, 102]]
    fp32 = TorchEngine(spec, dtype="float32", num_threads=THREADS)
    assert engine.classify(batch).shape == (2, 3)
    assert (np.argmax(engine.classify(batch), 1) == np.argmax(fp32.classify(batch), 1)).all()


def test_a_second_start_reuses_the_build_and_judges_it_again(models: dict[str, Path], cache: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Not quantised again, but not taken on its stored figures either: float32 loads and the probe is scored."""
    spec = load_spec(models["kept"])
    build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "kept")

    def forbidden(*args, **kwargs):
        raise AssertionError("a cached build must not be quantised again")

    monkeypatch.setattr(int8_scoring, "quantize_module", forbidden)
    again = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "kept")
    assert isinstance(again, Int8ScoringEngine) and again.build_source.source == "cache"
    gate = again.int8_gate
    assert gate.passed and gate.measured_on == "probe" and gate.inputs == int8_scoring_gate.PROBE_COUNT, gate


# -- real servers ------------------------------------------------------------------------------------------------
def test_a_real_server_reranks_on_the_int8_engine(models: dict[str, Path], cache: Path, runtime_factory) -> None:
    spec = load_spec(models["kept"])
    build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "kept")
    engine = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "kept")  # cached: probed
    srv = runtime_factory("--model", str(models["kept"]), "--dtype", "int8", "--engine-cache-dir", str(cache / "kept"))
    query = "which text talks about padding"
    docs = ["padding must never leak into the result", "the quick brown fox", "numbers 12345 and symbols",
            "a longer sentence with many more words than the others here"]
    with srv.client() as c:
        card = c.get("/v1/models").raise_for_status().json()["data"][0]
        body = c.post("/v1/rerank", json={"query": query, "documents": docs}).raise_for_status().json()
    assert card["dtype"] == "int8" and card["requested_dtype"] is None and card["int8_measured_on"] == "probe"
    assert card["int8_min_spearman"] == pytest.approx(engine.int8_gate.min_spearman)
    assert card["int8_top1_agreement"] == pytest.approx(engine.int8_gate.top1_agreement)
    assert card["int8_mean_spearman"] >= card["int8_min_spearman"]
    # the served scores are the int8 engine's (sigmoid of its logit), not float32's
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.path / "tokenizer.json"))
    tok.no_padding()
    encs = tok.encode_batch([(query, d) for d in docs])
    pairs = [PairInput(list(e.ids), list(e.type_ids) if any(e.type_ids) else None) for e in encs]
    expected = 1 / (1 + np.exp(-engine.classify(pairs)[:, 0]))
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)


def test_a_real_server_refuses_to_start_on_a_reranker_int8_damages(models: dict[str, Path], cache: Path,
                                                                  runtime_factory) -> None:
    srv = runtime_factory("--model", str(models["damaged"]), "--dtype", "int8",
                          "--engine-cache-dir", str(cache / "damaged"), wait_ready=False)
    assert srv.proc.wait(timeout=120) != 0
    log = srv.log()
    assert "int8 refused for rerank" in log and "min Spearman" in log and "--no-int8-strict" in log


def test_a_real_server_classifies_on_the_int8_engine(models: dict[str, Path], cache: Path, runtime_factory) -> None:
    spec = load_spec(models["classify"])
    build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "classify")
    engine = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "classify")  # cached: probed
    srv = runtime_factory("--model", str(models["classify"]), "--dtype", "int8",
                          "--engine-cache-dir", str(cache / "classify"))
    texts = ["padding must never leak into the result", "a", "the quick brown fox " * 20]
    with srv.client() as c:
        card = c.get("/v1/models").raise_for_status().json()["data"][0]
        body = c.post("/classify", json={"input": texts}).raise_for_status().json()
    assert card["dtype"] == "int8" and card["int8_label_agreement"] == pytest.approx(engine.int8_gate.label_agreement)
    assert card["int8_max_prob_diff"] == pytest.approx(engine.int8_gate.max_prob_diff)
    assert card["int8_min_spearman"] is None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.path / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=spec.max_length)
    probs = softmax(engine.classify([e.ids for e in tok.encode_batch(texts)]))
    labels = ["negative", "neutral", "positive"]
    for row, item in zip(probs, body["data"], strict=True):
        got = {ls["label"]: ls["score"] for ls in item["labels"]}
        assert item["label"] == labels[int(row.argmax())]
        assert all(got[labels[k]] == pytest.approx(row[k], abs=1e-5) for k in range(3))


def test_a_real_server_serves_float32_when_told_to_on_a_refused_reranker(models: dict[str, Path], cache: Path,
                                                                        runtime_factory) -> None:
    """The refused build is cached: its stored refusal is taken as it is (a refusal serves no int8) but its
    figures, measured by no one in this process, are not reported."""
    spec = load_spec(models["damaged"])
    assert not build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=cache / "damaged",
                                         strict=False).int8_gate.passed
    srv = runtime_factory("--model", str(models["damaged"]), "--dtype", "int8", "--no-int8-strict",
                          "--engine-cache-dir", str(cache / "damaged"))
    with srv.client() as c:
        card = c.get("/v1/models").raise_for_status().json()["data"][0]
        c.post("/v1/rerank", json={"query": "q", "documents": ["a", "b"]}).raise_for_status()
    assert card["dtype"] == "float32" and card["requested_dtype"] == "int8"
    assert card["int8_measured_on"] is None and card["int8_min_spearman"] is None
    assert "as stored with the cached build, not measured by this process" in srv.log()
