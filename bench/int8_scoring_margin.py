"""What sets SCORING_MARGIN_FACTOR (engines/int8_scoring_gate.py): the int8 scoring gate's judged figures against
the same figures on held-out inputs neither calibrated on nor judged, for rerankers and classifiers.

Each model is built as `--dtype int8` builds it (quantised on `scoring_sets`' calibrate side, judged on its judge
side) into a temporary engine cache; then float32 and the int8 build score held-out inputs:
  rerank:   queries of real prose (docstring summary lines, bench/prose.py) each with its own paragraph and
            GROUP_SIZE - 1 paragraphs of other docstrings (seeded), and groups formed the gate's way from
            bench-corpus texts (random vocabulary, seed HELD_OUT_SEED) with its longest texts as odd passages;
  classify: docstring paragraphs and summary lines, and bench-corpus texts.
Figures: the judged and held-out minimum / mean Spearman and top-1 agreement (rerank), label agreement and
largest probability difference (classify), and the deviation ratios (held-out distance from perfect over the
judged one: 1 - figure for Spearman and agreements, the difference itself for probabilities), which the margin
factor must cover.

Models: tiny random BERT cross-encoders (tests/tiny_models.py bert_reranker) at four initializer ranges and two
seeds, the tiny random 3-label BERT classifier, and all-MiniLM-L6-v2's trained encoder under a random head
(a reranker with one output and a classifier with three, as bench/rerank.py builds it): no trained reranker or
classifier is available offline here. One JSON line per model (and appended to
bench/results/int8-scoring-margin-cpu.jsonl by _common.record; a trial run: --results-dir /tmp/x).

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1 .venv/bin/python bench/int8_scoring_margin.py
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _common import ROOT, add_results_dir, corpus, record, run_meta
from embedfleet.runtime.engines.int8_scoring import Int8ScoringEngine, build_int8_scoring_engine
from embedfleet.runtime.engines.int8_scoring_gate import (
    GROUP_SIZE,
    MIN_SPEARMAN,
    SCORING_MARGIN_FACTOR,
    form_groups,
    judge,
    measure,
    resolution,
    spearman,
    split_scores,
)
from embedfleet.runtime.engines.quality_gate import Calibration, calibration_batches, run_calibration
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from fp8_gate import HELD_OUT_SEED
from prose import docstring_pairs

sys.path.insert(0, str(ROOT))


def minilm_head(root: Path, labels: int) -> Path:
    """all-MiniLM-L6-v2's encoder under a random head of `labels` outputs (seed 0), saved as a
    BertForSequenceClassification with its tokenizer."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    extra = {} if labels == 1 else {"id2label": {i: f"l{i}" for i in range(labels)},
                                    "label2id": {f"l{i}": i for i in range(labels)}}
    model = BertForSequenceClassification.from_pretrained(str(default_model_dir()), num_labels=labels, **extra)
    out = root / f"minilm-{labels}"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_dir() / name, out / name)
    return out


@functools.cache
def docstrings() -> list[tuple[str, list[str]]]:
    return docstring_pairs(limit_files=4000)[0]


def held_out_rerank(queries: int) -> Calibration:
    pairs = docstrings()
    rng = random.Random(HELD_OUT_SEED)
    by_head = list(dict.fromkeys(h for h, _ in pairs))
    body = {}
    for h, b in pairs:
        body.setdefault(h, b[0])
    paragraphs = sorted({p for _, b in pairs for p in b})
    heads = rng.sample(by_head, min(queries // 2, len(by_head)))
    qs, docs = [], []
    for h in heads:
        others = rng.sample([p for p in paragraphs if p != body[h]][:5000], GROUP_SIZE - 1)
        qs.append(h)
        docs.append([body[h], *others])
    texts = corpus(queries * 4, seed=HELD_OUT_SEED)
    long = sorted(texts, key=lambda t: -len(t.split()))[:64]
    made = form_groups(texts, long, ["x y " * 100, "? " * 50, "zz"], queries - len(qs), HELD_OUT_SEED)
    return Calibration([], qs + made.queries, docs + made.documents)


def held_out_classify(texts: int) -> Calibration:
    pairs = docstrings()
    rng = random.Random(HELD_OUT_SEED)
    prose = sorted({p for _, b in pairs for p in b} | {h for h, _ in pairs})
    return Calibration([*rng.sample(prose, texts // 2), *corpus(texts - texts // 2, seed=HELD_OUT_SEED)], [], [])


def row(name: str, path: Path, held: Calibration, threads: int) -> dict:
    spec = load_spec(path)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        engine = build_int8_scoring_engine(spec, num_threads=threads, cache_root=Path(cache), strict=False)
        gate = engine.int8_gate
        assert gate is not None and engine.build_source is not None
        int8 = Int8ScoringEngine(spec, engine.build_source.path / "model.xml", gate, threads)
        batches = calibration_batches(spec, held)
        fp32 = TorchEngine(spec, dtype="float32", num_threads=threads)
        reference, candidate = run_calibration(fp32.classify, batches), run_calibration(int8.classify, batches)
        held_figures = measure(spec.task, reference, candidate, held)
    judged = {k: getattr(gate, k) for k in ("min_spearman", "mean_spearman", "top1_agreement", "label_agreement",
                                            "max_prob_diff", "inputs")}
    out: dict = {"figure": "int8_scoring_margin", "model": name, "task": spec.task, "judged": judged,
                 "verdict": {"passed": gate.passed, "margin_factor": SCORING_MARGIN_FACTOR, "reason": gate.reason},
                 "held_out": {k: v for k, v in held_figures.items() if k != "task"}}

    def ratio(judged_dev: float, held_dev: float) -> float | None:
        return round(held_dev / judged_dev, 3) if judged_dev > 1e-9 else None

    if spec.task == "rerank":
        out["deviation_ratio"] = {
            "spearman": ratio(1 - gate.min_spearman, 1 - held_figures["min_spearman"]),
            "top1": ratio(1 - gate.top1_agreement, 1 - held_figures["top1_agreement"])}
        # like for like: the held-out queries in consecutive sets of the judged set's size, each set's minimum
        tol = resolution(reference)
        rho = np.array([spearman(r, c, tol) for r, c in zip(split_scores(reference, held.groups),
                                                             split_scores(candidate, held.groups), strict=True)])
        size = int(gate.inputs)
        chunks = [float(rho[i:i + size].min()) for i in range(0, len(rho) - size + 1, size)]
        out["held_out"].update(below_min_spearman=int((rho < MIN_SPEARMAN).sum()),
                               set_minima={"size": size, "sets": len(chunks), "median": float(np.median(chunks)),
                                           "worst": min(chunks), "best": max(chunks)})
        out["deviation_ratio"]["spearman_same_size_worst"] = ratio(1 - gate.min_spearman, 1 - min(chunks))
        out["deviation_ratio"]["spearman_same_size_median"] = ratio(1 - gate.min_spearman, 1 - float(np.median(chunks)))
    else:
        out["deviation_ratio"] = {
            "labels": ratio(1 - gate.label_agreement, 1 - held_figures["label_agreement"]),
            "prob_diff": ratio(gate.max_prob_diff, held_figures["max_prob_diff"])}
    out["held_out_verdict_without_margin"] = judge(held_figures, margin_factor=1.0, measured_on="held-out").passed
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=400, help="held-out rerank queries")
    ap.add_argument("--texts", type=int, default=1000, help="held-out classify texts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated model names to run")
    add_results_dir(ap, "int8-scoring-margin-cpu.jsonl")
    args = ap.parse_args()
    from tests.tiny_models import bert_reranker, build_all

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models: dict[str, Path] = {}
        wanted = set(filter(None, args.only.split(",")))
        for scale in (0.02, 0.1, 0.2, 0.5):
            for seed in (0, 1):
                name = f"tiny-rerank-{scale}-{seed}"
                if not wanted or name in wanted:
                    models[name] = bert_reranker(root / name, seed=seed, initializer_range=scale)
        if not wanted or "tiny-classify" in wanted:
            (root / "all").mkdir()
            models["tiny-classify"] = build_all(root / "all")["bert-classify"]
        for labels, name in ((1, "minilm-rerank"), (3, "minilm-classify")):
            if not wanted or name in wanted:
                models[name] = minilm_head(root, labels)
        held_rerank = held_out_rerank(args.queries)
        held_classify = held_out_classify(args.texts)
        meta = run_meta()  # one run: its rows share the date
        for name, path in models.items():
            spec = load_spec(path)
            out = row(name, path, held_rerank if spec.task == "rerank" else held_classify, args.threads)
            print(json.dumps(out), flush=True)
            record("int8-scoring-margin", out, results_dir=args.results_dir, meta=meta)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
