"""int8 on CPU for rerankers and sequence classifiers: the same OpenVINO + NNCF build as the embedders'
(engines/int8_cpu.py: same recipe, cached by model digest in the CPU class's folder under the same build
lock), judged on what these models serve. A cosine of logit vectors says little about either: a reranker's
score is one number whose meaning is its order within a query, and a classifier's is the label and its
probability.

Rerankers: calibration query/passage groups (calibration.json's 8 queries x 4 documents plus groups formed
deterministically from its texts, with long and degenerate passages and queries, see rerank_calibration) are
scored in float32 and int8. Each query's Spearman rank correlation between the two score lists must reach
MIN_SPEARMAN (the minimum over queries is judged; the mean is reported), and the top-1 passage must agree
for at least MIN_TOP1_AGREEMENT of the queries.
Classifiers: the calibration texts of the embedder gate (natural, degenerate and long) are classified in
both; the argmax label must agree for at least MIN_LABEL_AGREEMENT of the inputs and no probability may move
by more than MAX_PROB_DIFF.

The decisions are pure functions of the two score arrays (measure_rerank, measure_classify, judge); the
measured figures are cached with the build, so a second start judges them again without quantising.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedfleet.runtime.engines.base import Capabilities, pad_batch
from embedfleet.runtime.engines.cache_dir import BuildSource
from embedfleet.runtime.engines.int8_cpu import (
    INSTALL_HINT,
    MANIFEST,
    RECIPE,
    STRESS_TEXTS,
    CacheKey,
    Int8Rejected,
    build_once,
    int8_calibration,
    no_telemetry,
    quantize_module,
    refusal,
    unrelated_passages,
)
from embedfleet.runtime.engines.quality_gate import (
    Calibration,
    GateResult,
    calibration_batches,
    load_calibration,
    row_cosines,
    run_calibration,
)
from embedfleet.runtime.engines.torch_engine import EngineError, TorchEngine
from embedfleet.runtime.models.spec import ModelSpec

log = logging.getLogger(__name__)

# Thresholds. Spearman over a query's passages moves in steps: with 4 passages one swap of neighbours is
# 0.8, with 6 it is 0.943. The minimum over queries allows one neighbour swap in a 4-passage group and no
# more: 0.8; a reranker int8 damages reorders some query far below it (a random order averages 0). The
# top-1 passage is what a RAG pipeline keeps: it must agree on at least 90% of the queries (36 of 40).
# Scores float32 itself barely separates are ties (RANK_RESOLUTION of the spread of all calibration scores):
# trained rerankers give unrelated passages nearly equal low scores, whose order means nothing.
# No real reranker or classifier is available offline here; measured on tiny random BERT cross-encoders
# (tests/tiny_models.py bert_reranker, 40 queries; docs/performance.md "int8 on CPU"), with the head float32:
#   initializer range 0.1, seed 1: min Spearman 1.000, mean 1.000, top-1 1.000, Pearson 0.991 -> accepted
#   initializer range 0.1, seed 0: min Spearman -0.339 (one query reversed), top-1 0.950 -> refused
#   initializer range 0.2, seeds 0/1: min 0.815 / 0.800, mean 0.990 / 0.981, top-1 1.0 / 0.95 -> accepted
#   initializer range 0.5, seeds 0/1: min 0.086 / 0.771, top-1 0.825 / 0.850 -> refused
# so the bar separates models whose rankings int8 keeps from those where it reverses whole queries. With
# the head quantised too, the minimum fell to between -0.97 and 0.80 and seven of the eight were refused
# (initializer range 0.02 included, Pearson 0.57-0.60): hence HEAD_MATMULS.
MIN_SPEARMAN = 0.8
MIN_TOP1_AGREEMENT = 0.9
RANK_RESOLUTION = 0.05
# Classifiers: a label that flips is a wrong answer, so 98% of calibration inputs must keep theirs (one
# flip in 78 inputs is allowed: an input on the decision boundary); a probability moving by 0.05 changes
# no threshold a user would sensibly set at two decimals. The tiny random BERT classifier (3 labels) kept
# every label with a largest probability difference of 0.0001.
MIN_LABEL_AGREEMENT = 0.98
MAX_PROB_DIFF = 0.05
# The head (BERT's pooler and classifier, RoBERTa's dense and out_proj: two MatMuls on one vector per input)
# stays float32: it costs nothing next to the encoder, and int8 there rounds the served score itself.
HEAD_MATMULS = 2
SCORING_RECIPE = f"{RECIPE}-scoring-v1"
EXTRA_GROUPS = 32  # rerank groups formed from calibration.json's texts, besides its own 8 queries
GROUP_SIZE = 6


@dataclass(frozen=True)
class ScoreGateResult(GateResult):
    """A GateResult for scores: min_cosine carries the Pearson correlation of all scores (rerank) or the
    lowest cosine of logit vectors (classify), informative only; the fields below are what is judged."""

    min_spearman: float | None = None
    mean_spearman: float | None = None
    top1_agreement: float | None = None
    label_agreement: float | None = None
    max_prob_diff: float | None = None

    def summary(self) -> str:
        verdict = "accepted" if self.passed else "refused"
        if self.task == "rerank":
            figures = (f"min Spearman {self.min_spearman:.4f} (mean {self.mean_spearman:.4f}, threshold "
                       f"{MIN_SPEARMAN}), top-1 agreement {self.top1_agreement:.4f} (threshold {MIN_TOP1_AGREEMENT})")
        else:
            figures = (f"label agreement {self.label_agreement:.4f} (threshold {MIN_LABEL_AGREEMENT}), max "
                       f"probability difference {self.max_prob_diff:.4f} (threshold {MAX_PROB_DIFF})")
        return f"int8 {verdict} for {self.task}: {figures}; {self.reason}"


def card_fields(gate: GateResult | None) -> dict[str, float | None]:
    """What /v1/models reports of a scoring gate (int8_min_spearman, ...); empty for any other gate."""
    if not isinstance(gate, ScoreGateResult):
        return {}
    return {"int8_min_spearman": gate.min_spearman, "int8_mean_spearman": gate.mean_spearman,
            "int8_top1_agreement": gate.top1_agreement, "int8_label_agreement": gate.label_agreement,
            "int8_max_prob_diff": gate.max_prob_diff}


# -- pure measurements and decisions -----------------------------------------------------------------------
def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with tied values sharing their mean rank (what Spearman's correlation is defined on)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.arange(x.size, dtype=np.float64)
    for value in np.unique(x):
        tied = x == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def tie_classes(x: np.ndarray, tolerance: float) -> np.ndarray:
    """A class label per score, ordered like the scores: sorted neighbours closer than `tolerance` share one
    (chained: 1.0, 1.0+t/2, 1.0+t are one class). With tolerance 0 only equal scores share a class."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    order = np.argsort(x, kind="stable")
    labels = np.empty(x.size, dtype=np.int64)
    gaps = np.diff(x[order]) > tolerance
    labels[order] = np.concatenate([[0], np.cumsum(gaps)]) if x.size else []
    return labels


def spearman(a: np.ndarray, b: np.ndarray, tolerance: float = 0.0) -> float:
    """Spearman rank correlation in [-1, 1] of candidate `b` with reference `a`, at the reference's
    resolution: reference scores closer than `tolerance` are tied (average ranks), and the candidate's ranks
    within such a tie are averaged too, so reordering items the reference does not tell apart costs nothing.
    A reference that orders nothing agrees with any candidate (1.0: no order to break); a constant
    candidate for a reference that orders is no agreement (0.0), nor is a non-finite score anywhere."""
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"{a.size} reference and {b.size} candidate scores")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return 0.0
    classes = tie_classes(a, tolerance)
    ra, rb = average_ranks(classes), average_ranks(b)
    for c in np.unique(classes):
        rb[classes == c] = rb[classes == c].mean()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    na, nb = float(np.sqrt((ra * ra).sum())), float(np.sqrt((rb * rb).sum()))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.clip((ra * rb).sum() / (na * nb), -1.0, 1.0))


def _split(scores: np.ndarray, groups: Sequence[int]) -> list[np.ndarray]:
    flat = np.asarray(scores, dtype=np.float64).reshape(-1)
    if sum(groups) != flat.size or any(n < 1 for n in groups):
        raise ValueError(f"{flat.size} scores for groups {list(groups)}")
    return np.split(flat, np.cumsum(groups)[:-1]) if groups else []


def resolution(reference: np.ndarray) -> float:
    """The score difference below which the reference states no preference: RANK_RESOLUTION of the spread
    (standard deviation) of all its calibration scores."""
    ref = np.asarray(reference, dtype=np.float64).reshape(-1)
    return float(RANK_RESOLUTION * ref.std()) if ref.size and np.isfinite(ref).all() else 0.0


def measure_rerank(reference: np.ndarray, candidate: np.ndarray, groups: Sequence[int]) -> dict[str, Any]:
    """Per-query Spearman at the reference's resolution (min, mean, worst query) and the fraction of queries
    whose candidate top passage is among the reference's top (within the resolution of its best score)."""
    tol = resolution(reference)
    refs, cands = _split(reference, groups), _split(candidate, groups)
    rho = np.array([spearman(r, c, tol) for r, c in zip(refs, cands, strict=True)])
    top1 = np.array([bool(np.isfinite(c).all()) and r[int(np.argmax(c))] >= r.max() - tol
                     for r, c in zip(refs, cands, strict=True)])
    ref, cand = np.asarray(reference, np.float64).reshape(-1), np.asarray(candidate, np.float64).reshape(-1)
    pearson = float(row_cosines((ref - ref.mean())[None], (cand - cand.mean())[None])[0])
    return {"task": "rerank", "min_spearman": float(rho.min()), "mean_spearman": float(rho.mean()),
            "worst_query": int(np.argmin(rho)), "top1_agreement": float(top1.mean()), "queries": len(rho),
            "pearson": pearson, "resolution": tol, "finite": bool(np.isfinite(cand).all())}


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def measure_classify(reference: np.ndarray, candidate: np.ndarray) -> dict[str, Any]:
    """Label agreement, the largest probability difference (and its input), and the logits' cosines."""
    ref, cand = np.asarray(reference, np.float64), np.asarray(candidate, np.float64)
    if ref.shape != cand.shape or ref.ndim != 2:
        raise ValueError(f"logits of shape {ref.shape} and {cand.shape}")
    finite = bool(np.isfinite(cand).all())
    same = (np.argmax(ref, axis=1) == np.argmax(cand, axis=1)) & np.isfinite(cand).all(axis=1)
    diff = np.abs(softmax(ref) - softmax(np.nan_to_num(cand))).max(axis=1) if finite else np.ones(len(ref))
    cos = row_cosines(ref, cand)
    return {"task": "classify", "label_agreement": float(same.mean()), "max_prob_diff": float(diff.max()),
            "worst_input": int(np.argmax(diff)), "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
            "inputs": len(ref), "finite": finite}


def judge(figures: dict[str, Any]) -> ScoreGateResult:
    """The verdict on measured figures (from a build or the cache) against this module's thresholds."""
    finite = bool(figures["finite"])
    if figures["task"] == "rerank":
        lo, top1 = figures["min_spearman"], figures["top1_agreement"]
        passed = finite and lo >= MIN_SPEARMAN - 1e-9 and top1 >= MIN_TOP1_AGREEMENT - 1e-9
        if passed:
            reason = "every calibration query's ranking within threshold"
        elif not finite:
            reason = "int8 produced non-finite scores"
        elif lo < MIN_SPEARMAN - 1e-9:
            reason = f"calibration query {figures['worst_query']} has Spearman {lo:.4f} < {MIN_SPEARMAN}"
        else:
            reason = f"top-1 passage agrees on {top1:.4f} of queries < {MIN_TOP1_AGREEMENT}"
        return ScoreGateResult(passed, "rerank", figures["pearson"], figures["pearson"], MIN_SPEARMAN, reason,
                               order_preserved=passed, min_spearman=lo, mean_spearman=figures["mean_spearman"],
                               top1_agreement=top1)
    agree, diff = figures["label_agreement"], figures["max_prob_diff"]
    passed = finite and agree >= MIN_LABEL_AGREEMENT and diff <= MAX_PROB_DIFF
    if passed:
        reason = "labels and probabilities within threshold"
    elif not finite:
        reason = "int8 produced non-finite logits"
    elif agree < MIN_LABEL_AGREEMENT:
        reason = f"labels agree on {agree:.4f} of calibration inputs < {MIN_LABEL_AGREEMENT}"
    else:
        reason = (f"calibration input {figures['worst_input']} moves a probability by {diff:.4f} "
                  f"> {MAX_PROB_DIFF}")
    return ScoreGateResult(passed, "classify", figures["min_cosine"], figures["mean_cosine"], MIN_LABEL_AGREEMENT,
                           reason, order_preserved=agree == 1.0, label_agreement=agree, max_prob_diff=diff)


# -- calibration -------------------------------------------------------------------------------------------
def rerank_calibration(base: Calibration | None = None) -> Calibration:
    """calibration.json's queries and documents, plus EXTRA_GROUPS groups formed with a fixed seed from its
    texts: a query (the first words of one text; some degenerate: "?", a run of one word) with that text,
    GROUP_SIZE - 2 other texts and one long or degenerate passage (STRESS_TEXTS, unrelated-word passages near
    the token limit). Long and degenerate inputs set the widest activations, as for the embedder gate."""
    base = base or load_calibration()
    texts = base.texts
    odd = [*STRESS_TEXTS, *unrelated_passages(texts)]
    rng = random.Random(13)
    queries, documents = list(base.queries), [list(d) for d in base.documents]
    for g in range(EXTRA_GROUPS):
        own = texts[g % len(texts)]
        words = own.split()
        query = STRESS_TEXTS[g % len(STRESS_TEXTS)] if g % 8 == 7 else " ".join(words[: max(3, len(words) // 3)])
        others = rng.sample([t for t in texts if t != own], GROUP_SIZE - 2)
        queries.append(query)
        documents.append([own, *others, odd[g % len(odd)]])
    return Calibration(list(texts), queries, documents)


def scoring_calibration(task: str) -> Calibration:
    """What a reranker or classifier is calibrated on and judged by."""
    return rerank_calibration() if task == "rerank" else int8_calibration()


def calibration_digest(calibration: Calibration) -> str:
    blob = json.dumps([calibration.texts, calibration.queries, calibration.documents]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# -- the model and its engine ------------------------------------------------------------------------------
def uses_segments(spec: ModelSpec) -> bool:
    """True when the model has a segment (token type) embedding to feed: BERT's pairs are A=0, B=1."""
    config = json.loads((spec.path / "config.json").read_text())
    return int(config.get("type_vocab_size") or 0) > 1


class _Scored(torch.nn.Module):
    """The sequence classification model returning its logits (float32), with segment ids when it has them."""

    def __init__(self, model: torch.nn.Module, segments: bool) -> None:
        super().__init__()
        self.model, self.segments = model, segments

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"token_type_ids": token_type_ids} if self.segments else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits.float()


def feeds(batch: list, pad_id: int, segments: bool) -> dict[str, np.ndarray]:
    """The int8 graph's inputs: ids, mask and (for models with segments) type ids, zeros where absent."""
    padded = pad_batch(batch, pad_id)
    out = {"input_ids": padded.ids, "attention_mask": padded.mask}
    if segments:
        out["token_type_ids"] = padded.type_ids if padded.type_ids is not None else np.zeros_like(padded.ids)
    return out


class Int8ScoringEngine:
    """Serves a reranker or classifier from its cached OpenVINO int8 build (the Engine protocol: classify,
    which is also what /v1/rerank runs, pairs in and one logit per pair out)."""

    fp8_gate: GateResult | None = None
    preemptible = False
    build_source: BuildSource | None = None  # where the build came from (set by build_int8_scoring_engine)

    def __init__(self, spec: ModelSpec, model_xml: Path, gate: GateResult | None, num_threads: int) -> None:
        no_telemetry()
        import openvino as ov

        self.spec = spec
        self.effective_dtype = "int8"
        self.int8_gate = gate
        self.segments = uses_segments(spec)
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
        if num_threads > 0:
            config["INFERENCE_NUM_THREADS"] = num_threads
        self._request = ov.Core().compile_model(str(model_xml), "CPU", config).create_infer_request()
        self.capabilities = Capabilities(tasks=(spec.task,), pooling=spec.pooling, max_tokens=spec.max_length,
                                         dtypes=("int8",), device="cpu", dim=spec.output_dim or len(spec.labels))

    def warmup(self) -> None:
        token = self.spec.pad_token_id + 1
        self.classify([[token] * 8, [token] * 3])

    def classify(self, batch: list) -> np.ndarray:
        out = self._request.infer(feeds(batch, self.spec.pad_token_id, self.segments))
        return np.array(out[0], dtype=np.float32)[: len(batch)]

    def _unsupported(self, batch: list) -> Any:
        raise EngineError(f"the int8 CPU engine of a {self.spec.task} model serves {self.spec.task} only")

    embed = embed_sparse = embed_tokens = _unsupported


def build_int8_scoring_engine(spec: ModelSpec, *, num_threads: int, strict: bool = True,
                              cache_root: Path | None = None,
                              calibration: Calibration | None = None) -> Int8ScoringEngine | TorchEngine:
    """The int8 engine if the gate passes; otherwise Int8Rejected (strict) or the float32 torch engine,
    whose `int8_gate` carries the refused measurement. Cached by model digest like the embedders' build."""
    why = refusal(spec, "cpu")
    if why:
        raise Int8Rejected(why)
    if spec.task not in ("rerank", "classify"):
        raise Int8Rejected(f"{spec.name} is a {spec.task} model; the scoring gate judges rerankers and classifiers")
    try:
        no_telemetry()
        import nncf
        import openvino as ov
    except ImportError as exc:
        raise EngineError(f"{INSTALL_HINT} ({exc})") from None
    calibration = calibration or scoring_calibration(spec.task)
    key = CacheKey(spec.digest, f"{SCORING_RECIPE}-{spec.task}", ov.__version__, nncf.__version__,
                   calibration_digest(calibration))
    manifest, source, fp32 = build_once(
        spec, key, cache_root, num_threads, lambda fp32, path: _build(fp32, spec, key, path, calibration, num_threads))
    gate = judge(manifest["figures"])
    if gate.passed:
        log.info("%s: %s", spec.name, gate.summary())
        served = Int8ScoringEngine(spec, source.path / "model.xml", gate, num_threads)
        served.build_source = source
        return served
    if strict:
        raise Int8Rejected(f"{gate.summary()}; the server will not start (serve --dtype float32, or pass "
                           "--no-int8-strict to serve float32 when int8 is refused)")
    log.warning("%s: %s; serving float32 (--no-int8-strict)", spec.name, gate.summary())
    engine = fp32 or TorchEngine(spec, dtype="float32", num_threads=num_threads)
    engine.int8_gate = gate
    engine.build_source = source  # the int8 build was made (or found) and judged, though float32 serves
    return engine


def _build(fp32: TorchEngine, spec: ModelSpec, key: CacheKey, path: Path, calibration: Calibration,
           num_threads: int) -> dict[str, Any]:
    """Quantise on the calibration inputs, score them in both precisions, publish the build atomically."""
    started = time.perf_counter()
    batches = calibration_batches(spec, calibration)
    reference = run_calibration(fp32.classify, batches)
    segments, pad = uses_segments(spec), spec.pad_token_id
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        quantize_module(_Scored(fp32.model, segments), [[feeds([x], pad, segments) for x in b] for b in batches],
                        feeds(batches[0][:2], pad, segments), tmp, keep_last=HEAD_MATMULS)
        candidate = run_calibration(Int8ScoringEngine(spec, tmp / "model.xml", None, num_threads).classify, batches)
        figures = (measure_rerank(reference, candidate, calibration.groups) if spec.task == "rerank"
                   else measure_classify(reference, candidate))
        manifest = {"key": asdict(key), "figures": figures, "seconds": round(time.perf_counter() - started, 2)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("%s: int8 built in %.1fs into %s", spec.name, manifest["seconds"], path)
    return manifest
