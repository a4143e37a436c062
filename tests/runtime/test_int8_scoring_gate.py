"""The int8 scoring gate (rerankers, classifiers) judges out of sample, with a margin, and never trusts stored
figures: the inputs a build is quantised on and those it is judged on are disjoint (pure, and spied on in real
builds); a cached build whose `int8.json` was forged to perfect figures over bad weights (another model's build,
zeroed weights) is judged again on the probe against float32 and built again, never served; /v1/models reports
what this process measured (the probe of a cached build), not what the file says. Real OpenVINO/NNCF builds of
tiny random BERT models."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedfleet.runtime.engines import int8_scoring
from embedfleet.runtime.engines.int8_cpu import MANIFEST, build_int8_engine
from embedfleet.runtime.engines.int8_scoring import Int8ScoringEngine, build_int8_scoring_engine
from embedfleet.runtime.engines.int8_scoring_gate import (
    MIN_SPEARMAN,
    SCORING_MARGIN_FACTOR,
    card_fields,
    classify_sets,
    judge,
    probe_judge,
    rerank_sets,
)
from embedfleet.runtime.engines.quality_gate import calibration_batches, run_calibration
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.service import ModelService
from tests.tiny_models import bert_classifier, bert_reranker, encoder_family_embedder

pytest.importorskip("openvino")
pytest.importorskip("nncf")

THREADS = 2
PERFECT = {"rerank": {"min_spearman": 1.0, "mean_spearman": 1.0, "top1_agreement": 1.0, "pearson": 1.0,
                      "finite": True},
           "classify": {"label_agreement": 1.0, "max_prob_diff": 0.0, "min_cosine": 1.0, "mean_cosine": 1.0,
                        "finite": True}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    # a reranker and a classifier int8 keeps when judged out of sample (min Spearman 0.943; labels all kept,
    # largest probability difference 0.00002), and for each another model of the same graph that scores and
    # labels the same inputs differently (a wider initializer range: int8 refuses these, which does not matter
    # here; their builds are what a tenant could copy into the first one's folder)
    return {"rerank": bert_reranker(root / "rerank", seed=1, initializer_range=0.2),
            "rerank-other": bert_reranker(root / "rerank-other", seed=0, initializer_range=0.5),
            "classify": bert_classifier(root / "classify", seed=0),
            "classify-other": bert_classifier(root / "classify-other", seed=0, initializer_range=0.5)}


@pytest.fixture(scope="module")
def seen() -> dict[str, dict[str, set[tuple[int, ...]]]]:
    """What the rerank and classify builds (in `builds`) calibrated on and what their gates scored."""
    return {name: {"quantised": set(), "judged": set()} for name in ("rerank", "classify")}


@pytest.fixture(scope="module")
def builds(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
           seen: dict[str, dict[str, set[tuple[int, ...]]]]) -> dict[str, Path]:
    """One build of each model, each in its own engine cache; tests spoil copies of them. The rerank and
    classify builds are spied on (`seen`): one build serves both, a real build being most of this file's time."""
    out = {}
    for name, path in models.items():
        root = tmp_path_factory.mktemp(f"engines-{name}")
        with pytest.MonkeyPatch.context() as patch:
            if name in seen:
                spy_on_the_build(patch, seen[name])
            engine = build_int8_scoring_engine(load_spec(path), num_threads=THREADS, cache_root=root, strict=False)
        if name in seen:
            assert engine.int8_gate is not None and engine.int8_gate.measured_on == "judge"
        out[name] = root
    return out


def spy_on_the_build(patch: pytest.MonkeyPatch, seen: dict[str, set[tuple[int, ...]]]) -> None:
    quantize, classify = int8_scoring.quantize_module, Int8ScoringEngine.classify

    def spy_quantize(module, samples, example, out, *args, **kwargs):
        for batch in samples:
            for feed in batch:
                seen["quantised"].add(key(feed["input_ids"][0][feed["attention_mask"][0] == 1]))
        return quantize(module, samples, example, out, *args, **kwargs)

    def spy_classify(self, batch):
        seen["judged"].update(key(x) for x in batch)
        return classify(self, batch)

    patch.setattr(int8_scoring, "quantize_module", spy_quantize)
    patch.setattr(Int8ScoringEngine, "classify", spy_classify)


def copy_cache(root: Path, to: Path) -> Path:
    """A copy of an engine cache, and the one build folder in it."""
    shutil.copytree(root, to)
    (manifest,) = to.rglob(MANIFEST)
    return manifest.parent


def forge(folder: Path, figures: dict[str, Any]) -> None:
    """What a tenant's pod can write: the build's stored figures replaced."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["figures"].update(figures)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def key(x: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in getattr(x, "ids", x))


# -- pure: the sets and the margin ----------------------------------------------------------------------------
def test_no_query_passage_or_text_calibrated_on_is_judged(models: dict[str, Path]) -> None:
    sets = rerank_sets()
    assert sets == rerank_sets(), "the same sets every time"
    texts = {side: set(c.queries) | {d for docs in c.documents for d in docs} for side, c in
             (("calibrate", sets.calibrate), ("judge", sets.judge))}
    assert not texts["calibrate"] & texts["judge"]
    assert not set(sets.calibrate.pairs) & set(sets.judge.pairs)
    assert set(sets.probe.pairs) <= set(sets.judge.pairs) and len(sets.probe.queries) == 8
    assert len(sets.judge.queries) >= 30 and len(sets.calibrate.queries) >= 30
    spec = load_spec(models["classify"])
    texts_sets = classify_sets(spec.path / "tokenizer.json", spec.max_length)
    assert not set(texts_sets.calibrate.texts) & set(texts_sets.judge.texts)
    assert set(texts_sets.probe.texts) <= set(texts_sets.judge.texts) and len(texts_sets.probe.texts) == 8


def test_figures_at_the_thresholds_are_refused_by_the_margin_and_kept_by_a_probe() -> None:
    assert SCORING_MARGIN_FACTOR > 1
    at = {"task": "rerank", "min_spearman": MIN_SPEARMAN, "mean_spearman": 0.95, "top1_agreement": 0.95,
          "worst_query": 4, "queries": 34, "pearson": 0.99, "finite": True}
    refused = judge(at)
    assert not refused.passed and "judged query 4" in refused.reason and "margin factor" in refused.reason
    assert judge(at, margin_factor=1.0).passed, "without the margin it would pass"
    assert probe_judge({**at, "queries": 8, "top1_agreement": 7 / 8}).passed, "7 of 8 is 90% of a probe of 8"
    assert not probe_judge({**at, "queries": 8, "top1_agreement": 6 / 8}).passed
    labels = {"task": "classify", "label_agreement": 0.98, "max_prob_diff": 0.01, "worst_input": 2,
              "min_cosine": 0.99, "mean_cosine": 0.99, "inputs": 50, "finite": True}
    assert not judge(labels).passed and judge(labels, margin_factor=1.0).passed
    assert not judge({**labels, "label_agreement": 1.0, "max_prob_diff": 0.04}).passed  # MAX_PROB_DIFF / factor


# -- real builds ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rerank", "classify"])
def test_a_build_is_quantised_on_inputs_it_is_not_judged_on(
        name: str, builds: dict[str, Path], seen: dict[str, dict[str, set[tuple[int, ...]]]]) -> None:
    """Spied on in a real build (`builds`): what the quantiser calibrates on, what the int8 engine scores
    while being judged."""
    quantised, judged = seen[name]["quantised"], seen[name]["judged"]
    assert builds and quantised and judged
    both = quantised & judged
    assert not both, f"{len(both)} of {len(judged)} judged inputs were calibrated on"


def replace_weights(build: Path, other: Path) -> None:
    """Another model's int8 build, same graph: it loads, runs and scores something else."""
    for name in ("model.xml", "model.bin"):
        shutil.copyfile(other / name, build / name)


def zero_weights(build: Path, other: Path) -> None:
    """The weights file zeroed in place (same size): it loads, runs and scores nothing."""
    (build / "model.bin").write_bytes(bytes((build / "model.bin").stat().st_size))


@pytest.mark.parametrize(("name", "spoil"), [("rerank", replace_weights), ("rerank", zero_weights),
                                             ("classify", replace_weights)])
def test_a_forged_verdict_over_a_bad_build_is_never_served(name: str, spoil, models: dict[str, Path],
                                                           builds: dict[str, Path], tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Bad weights and an int8.json saying they are perfect: the next start judges the build again on the
    probe, finds it bad, builds it again and serves that (or refuses int8); the stored figures decide nothing."""
    spec = load_spec(models[name])
    folder = copy_cache(builds[name], tmp_path / "engines")
    (other,) = builds[f"{name}-other"].rglob(MANIFEST)
    spoil(folder, other.parent)
    forge(folder, PERFECT[spec.task])
    batches = calibration_batches(spec, rerank_sets().judge if spec.task == "rerank" else
                                  classify_sets(spec.path / "tokenizer.json", spec.max_length).judge)
    try:
        bad_scores = run_calibration(Int8ScoringEngine(spec, folder / "model.xml", None, THREADS).classify, batches)
    except RuntimeError:  # zeroed shape constants too: it does not even compile
        bad_scores = None

    with caplog.at_level(logging.INFO, logger="embedfleet.runtime.engines.int8_cpu"):
        served = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=tmp_path / "engines", strict=False)
    lines = [r.getMessage() for r in caplog.records]
    assert any("fails its re-judgement" in line and str(folder) in line for line in lines), lines
    assert served.build_source is not None and served.build_source.source == "built"
    gate = served.int8_gate
    assert gate is not None and gate.measured_on == "judge", "the verdict is the rebuild's, not the forged one"
    if isinstance(served, Int8ScoringEngine):
        fp32 = TorchEngine(spec, dtype="float32", num_threads=THREADS)
        got, ref = run_calibration(served.classify, batches), run_calibration(fp32.classify, batches)
        assert bad_scores is None or not np.allclose(got, bad_scores, atol=1e-4), "the spoiled weights were served"
        assert np.corrcoef(ref.reshape(-1), got.reshape(-1))[0, 1] > 0.95
    # the rebuilt folder is a good build again: the next start judges it on the probe and keeps its verdict
    again = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=tmp_path / "engines", strict=False)
    assert again.build_source.source == "cache" and again.int8_gate.passed == gate.passed


def test_unreadable_stored_figures_are_a_build_to_make_again(models: dict[str, Path], builds: dict[str, Path],
                                                             tmp_path: Path) -> None:
    spec = load_spec(models["rerank"])
    folder = copy_cache(builds["rerank"], tmp_path / "engines")
    forge(folder, {"min_spearman": "1.0", "top1_agreement": None})
    served = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=tmp_path / "engines")
    assert served.build_source.source == "built" and served.int8_gate.measured_on == "judge"


# -- what /v1/models reports --------------------------------------------------------------------------------------
def test_the_card_reports_the_probe_this_process_measured_not_the_stored_figures(
        models: dict[str, Path], builds: dict[str, Path], tmp_path: Path, runtime_factory) -> None:
    """Figures forged to a value no measurement gives (still passing, so the build is probed and serves):
    in-process and on a real server's /v1/models, the figures are the probe's."""
    spec = load_spec(models["rerank"])
    folder = copy_cache(builds["rerank"], tmp_path / "engines")
    forged = {"min_spearman": 0.912345, "mean_spearman": 0.987654, "top1_agreement": 0.999}
    forge(folder, forged)
    engine = build_int8_scoring_engine(spec, num_threads=THREADS, cache_root=tmp_path / "engines")
    gate = engine.int8_gate
    assert isinstance(engine, Int8ScoringEngine) and engine.build_source.source == "cache"
    assert gate.measured_on == "probe" and gate.inputs == len(rerank_sets().probe.queries)
    fields = card_fields(gate)
    assert fields["int8_measured_on"] == "probe"
    assert fields["int8_min_spearman"] != forged["min_spearman"]
    assert fields["int8_mean_spearman"] != forged["mean_spearman"]
    srv = runtime_factory("--model", str(models["rerank"]), "--dtype", "int8",
                          "--engine-cache-dir", str(tmp_path / "engines"))
    with srv.client() as c:
        card = c.get("/v1/models").raise_for_status().json()["data"][0]
    assert card["dtype"] == "int8" and card["int8_measured_on"] == "probe"
    for field in ("min_spearman", "mean_spearman", "top1_agreement"):
        assert card[f"int8_{field}"] != forged[field]
        assert card[f"int8_{field}"] == pytest.approx(getattr(gate, field), abs=1e-6)


def test_an_embedder_card_reports_its_probe_cosine_not_the_stored_one(tmp_path: Path) -> None:
    spec = load_spec(encoder_family_embedder(tmp_path, "roberta", 0))
    build_int8_engine(spec, num_threads=THREADS, cache_root=tmp_path / "engines")
    (manifest,) = (tmp_path / "engines").rglob(MANIFEST)
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "min_cosine": 0.9999876}))
    engine = build_int8_engine(spec, num_threads=THREADS, cache_root=tmp_path / "engines")
    gate = engine.int8_gate
    assert gate is not None and gate.passed and gate.measured_on == "probe"
    reported = ModelService.int8_min_cosine.fget(type("Svc", (), {"engine": engine})())  # type: ignore[attr-defined]
    assert reported == gate.min_cosine and reported != 0.9999876
    assert card_fields(gate) == {"int8_measured_on": "probe"}
