"""The int8 scoring gate's inputs and verdicts (rerankers and sequence classifiers): quantise on one set, judge
on another, with a margin, and judge a cached build again before it serves. The scoring twin of
engines/int8_gate.py; engines/int8_scoring.py builds and serves.

A cosine of logit vectors says little about these models: a reranker's score is one number whose meaning is
its order within a query, and a classifier's is the label and its probability. So they are judged on that.

Sets (`scoring_sets`; deterministic, nothing in both calibrate and judge, the probe a part of judge):
  rerank:   calibration.json's 8 query groups alternate (0, 2, 4, 6 calibrate; 1, 3, 5, 7 judge), and each side
            gets EXTRA_GROUPS groups of GROUP_SIZE formed from its own half of the file's texts
            (int8_gate.split_texts) with that side's odd passages: the calibrate side STRESS_TEXTS and
            unrelated-word passages at UNRELATED_SEED, the judge side JUDGE_STRESS_TEXTS and passages at
            JUDGE_UNRELATED_SEED. A judged group sharing its query or a passage with any calibrated group is
            dropped: the file's group 1, whose query is a text of the calibrate half, and one formed group whose
            query, "python list comprehension", is the file's calibrated group 4's (34 judged queries remain).
  classify: the embedder gate's sets (int8_gate.int8_sets): halves of the file's texts, degenerate runs,
            unrelated-word and rare-vocabulary passages, each side drawn separately.
  probe:    PROBE_COUNT judged groups (rerank) or texts (classify), spread over length.

Verdict (`judge`): a reranker's judged minimum Spearman over queries, and its top-1 agreement, must leave a
margin over MIN_SPEARMAN and MIN_TOP1_AGREEMENT; a classifier's label agreement and largest probability
difference over MIN_LABEL_AGREEMENT and MAX_PROB_DIFF. As in the embedder gate, the margin is on the distance
from perfect: a figure whose ideal is 1 must reach 1 - (1 - threshold) / SCORING_MARGIN_FACTOR, the
probability difference MAX_PROB_DIFF / SCORING_MARGIN_FACTOR, because served inputs reach further than any
judged set (measured figures beside the constant).

Probe (`probe_judge`): a build found on disk is never trusted on its stored figures (its folder is writable by
the tenant's pod). Before it serves, float32 and the build score the probe, and the thresholds themselves
(no margin) must hold there: a substituted, corrupted or zeroed build fails. A build crafted to match float32
on the probe inputs alone would pass: the probe is a check on what was stored, not a full judgement.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from embedfleet.runtime.engines.int8_gate import (
    JUDGE_STRESS_TEXTS,
    JUDGE_UNRELATED_SEED,
    PROBE_COUNT,
    STRESS_TEXTS,
    int8_sets,
    split_texts,
    unrelated_passages,
)
from embedfleet.runtime.engines.quality_gate import Calibration, GateResult, load_calibration, row_cosines

# Thresholds. Spearman over a query's passages moves in steps: with 4 passages one swap of neighbours is
# 0.8, with 6 it is 0.943. The minimum over queries allows one neighbour swap in a 4-passage group and no
# more: 0.8; a reranker int8 damages reorders some query far below it (a random order averages 0). The
# top-1 passage is what a RAG pipeline keeps: it must agree on at least 90% of the queries.
# Scores float32 itself barely separates are ties (RANK_RESOLUTION of the spread of all judged scores):
# trained rerankers give unrelated passages nearly equal low scores, whose order means nothing.
# The head (pooler and classifier) stays float32 (engines/int8_scoring.py HEAD_MATMULS): quantised as well, it
# brought the minimum of tiny random BERT cross-encoders down to between -0.97 and 0.80 (docs/performance.md).
MIN_SPEARMAN = 0.8
MIN_TOP1_AGREEMENT = 0.9
RANK_RESOLUTION = 0.05
# Classifiers: a label that flips is a wrong answer, so 98% of inputs must keep theirs (an input on the
# decision boundary may flip); a probability moving by 0.05 changes no threshold a user would sensibly set at
# two decimals.
MIN_LABEL_AGREEMENT = 0.98
MAX_PROB_DIFF = 0.05
# How much further than the judged figures served inputs reach, in distance from perfect (1 - Spearman,
# 1 - agreement, the probability difference itself): held-out over judged, measured with bench/int8_scoring_margin.py
# (bench/results/int8-scoring-margin-cpu.jsonl; Intel Xeon, 2 cores), each model built from `scoring_sets`'
# calibrate side and judged on its judge side (34 queries, 65-69 texts), then scored on held-out inputs neither
# calibrated on nor judged (400 queries: docstring summaries over their paragraphs and bench-corpus groups;
# 1,000 texts). No trained reranker or classifier is available offline; all-MiniLM-L6-v2's trained encoder
# under a random head stands in for one:
#   MiniLM classifier (3 labels)  label agreement 0.9855 judged, 0.976 held-out: 1.66x; largest probability
#                                 difference 0.00116 judged, 0.00207 held-out: 1.79x
#   MiniLM reranker               min Spearman 0.815 / 0.824 (0.96x); top-1 agreement 0.971 / 0.975 (0.85x)
#   tiny random BERT rerankers    top-1 agreement 0.63x-1.15x (8 models: initializer range 0.02-0.5, seeds 0/1)
#   tiny random BERT classifier   largest probability difference 1.11x (labels all kept on both sides)
# The worst ratio measured on these figures is 1.79x; the factor covers it. The minimum Spearman over queries is
# another matter: it is the minimum of a discrete, noisy figure, and it falls with the number of queries taken.
# Over 400 held-out queries the tiny rerankers' minimum fell 0.45x-7.0x as far as over the 34 judged ones
# (7.0x: the one tiny model the gate accepts, 0.943 judged, 0.600 held-out, 3 of 400 queries below 0.8). Cut into
# sets of 34 held-out queries, the median set's minimum was within 0.19x-1.29x of the judged one, the worst of
# 11 sets up to 7.0x. So the judged minimum speaks for a set of its size, not for every served query: the gate
# does not promise that no served query falls below MIN_SPEARMAN (docs/runtime.md). At 2.0: the MiniLM
# classifier is refused (0.9855 < 0.99; held-out it indeed misses 0.98, where no margin would have kept it), the
# MiniLM reranker is refused (0.815 < 0.9; held-out it keeps 0.8: what the margin costs), and of the tiny
# models one reranker (range 0.2, seed 1) and the classifiers at range 0.02 (difference 0.00002) and 0.2 seed 1
# (0.0241 < 0.025) are kept.
SCORING_MARGIN_FACTOR = 2.0
EXTRA_GROUPS = 32  # rerank groups formed from each half of calibration.json's texts, besides the file's own
GROUP_SIZE = 6
GROUP_SEED = 13  # the draw of each formed group's other passages (the judge side uses GROUP_SEED + 1)


@dataclass(frozen=True)
class ScoringSets:
    """What a reranker or classifier is quantised on (`calibrate`), judged on (`judge`, sharing no query,
    passage or text with it) and, when found cached, judged again on (`probe`, a part of `judge`)."""

    calibrate: Calibration
    judge: Calibration
    probe: Calibration

    def digest_parts(self) -> list[Any]:
        """The texts a build depends on, for its cache key."""
        return [[c.texts, c.queries, c.documents] for c in (self.calibrate, self.judge, self.probe)]


@dataclass(frozen=True)
class ScoreGateResult(GateResult):
    """A GateResult for scores: min_cosine carries the Pearson correlation of all scores (rerank) or the
    lowest cosine of logit vectors (classify), informative only; the fields below are what is judged, against
    the thresholds less the margin `margin_factor` (1.0 on a probe)."""

    min_spearman: float | None = None
    mean_spearman: float | None = None
    top1_agreement: float | None = None
    label_agreement: float | None = None
    max_prob_diff: float | None = None
    inputs: int = 0  # judged queries (rerank) or texts (classify)

    def summary(self) -> str:
        verdict = "accepted" if self.passed else "refused"
        f = self.margin_factor
        if self.task == "rerank":
            figures = (f"min Spearman {self.min_spearman:.4f} (mean {self.mean_spearman:.4f}, required "
                       f"{agreement_bound(MIN_SPEARMAN, f):.4f}), top-1 agreement {self.top1_agreement:.4f} "
                       f"(required {agreement_bound(MIN_TOP1_AGREEMENT, f):.4f})")
        else:
            figures = (f"label agreement {self.label_agreement:.4f} (required "
                       f"{agreement_bound(MIN_LABEL_AGREEMENT, f):.4f}), max probability difference "
                       f"{self.max_prob_diff:.4f} (allowed {MAX_PROB_DIFF / f:.4f})")
        where = f"{self.inputs} {_label(self.measured_on)} {'queries' if self.task == 'rerank' else 'inputs'}"
        return f"int8 {verdict} for {self.task} on {where} (margin factor {f}): {figures}; {self.reason}"


def _label(measured_on: str) -> str:
    """How a verdict's inputs are named in its messages: judged (also for stored figures, which say so after the
    verdict: int8_cpu.STORED_NOTE), probe, held-out."""
    return {"judge": "judged", "stored": "judged"}.get(measured_on, measured_on)


def agreement_bound(threshold: float, margin_factor: float) -> float:
    """What a figure whose ideal is 1 (Spearman, an agreement) must reach so that served inputs, reaching
    `margin_factor` times further from 1 than the judged ones, still keep `threshold`."""
    return 1.0 - (1.0 - threshold) / margin_factor


def card_fields(gate: GateResult | None) -> dict[str, Any]:
    """What /v1/models reports of an int8 gate: where this process measured it (`int8_measured_on`: "judge"
    when it built and judged the build, "probe" when it judged a cached build again) and, for rerankers and
    classifiers, the figures. A cached refusal taken as stored was measured by nobody here: no figures."""
    if gate is None or gate.measured_on not in ("judge", "probe"):
        return {}
    out: dict[str, Any] = {"int8_measured_on": gate.measured_on}
    if isinstance(gate, ScoreGateResult):
        out.update(int8_min_spearman=gate.min_spearman, int8_mean_spearman=gate.mean_spearman,
                   int8_top1_agreement=gate.top1_agreement, int8_label_agreement=gate.label_agreement,
                   int8_max_prob_diff=gate.max_prob_diff)
    return out


# -- pure measurements -----------------------------------------------------------------------------------------
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


def split_scores(scores: np.ndarray, groups: Sequence[int]) -> list[np.ndarray]:
    """Each query's scores, by the number of passages per query."""
    flat = np.asarray(scores, dtype=np.float64).reshape(-1)
    if sum(groups) != flat.size or any(n < 1 for n in groups):
        raise ValueError(f"{flat.size} scores for groups {list(groups)}")
    return np.split(flat, np.cumsum(groups)[:-1]) if groups else []


def resolution(reference: np.ndarray) -> float:
    """The score difference below which the reference states no preference: RANK_RESOLUTION of the spread
    (standard deviation) of all its scores."""
    ref = np.asarray(reference, dtype=np.float64).reshape(-1)
    return float(RANK_RESOLUTION * ref.std()) if ref.size and np.isfinite(ref).all() else 0.0


def measure_rerank(reference: np.ndarray, candidate: np.ndarray, groups: Sequence[int]) -> dict[str, Any]:
    """Per-query Spearman at the reference's resolution (min, mean, worst query) and the fraction of queries
    whose candidate top passage is among the reference's top (within the resolution of its best score)."""
    tol = resolution(reference)
    refs, cands = split_scores(reference, groups), split_scores(candidate, groups)
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


def measure(task: str, reference: np.ndarray, candidate: np.ndarray, calibration: Calibration) -> dict[str, Any]:
    """measure_rerank (by `calibration`'s groups) or measure_classify."""
    if task == "rerank":
        return measure_rerank(reference, candidate, calibration.groups)
    return measure_classify(reference, candidate)


# -- verdicts ----------------------------------------------------------------------------------------------------
def _needed(threshold: float, count: int, round_down: bool) -> float:
    """The agreement a set of `count` inputs must show for `threshold`: on a probe (`round_down`) at least
    floor(threshold x count) of them, since 8 inputs cannot show 90% (7 of 8 must agree, not 8)."""
    if not round_down or count < 1:
        return threshold
    return math.floor(threshold * count + 1e-9) / count


def judge(figures: dict[str, Any], margin_factor: float = SCORING_MARGIN_FACTOR, measured_on: str = "judge",
          round_down: bool = False) -> ScoreGateResult:
    """The verdict on measured figures: each must reach its threshold less the margin (`agreement_bound`,
    MAX_PROB_DIFF / margin_factor). A pure function of the figures. `measured_on` says what they were measured
    on ("judge": the judged set; "probe"; "stored": a cached build's file, measured by no one here)."""
    if margin_factor < 1.0:
        raise ValueError(f"margin factor {margin_factor} must be >= 1 (a margin never loosens the gate)")
    finite = bool(figures["finite"])
    bound = f"with margin factor {margin_factor}" if margin_factor > 1 else "no margin"
    said = _label(measured_on)
    if figures["task"] == "rerank":
        lo, top1, n = float(figures["min_spearman"]), float(figures["top1_agreement"]), int(figures["queries"])
        need_rho = agreement_bound(MIN_SPEARMAN, margin_factor)
        need_top1 = _needed(agreement_bound(MIN_TOP1_AGREEMENT, margin_factor), n, round_down)
        passed = finite and lo >= need_rho - 1e-9 and top1 >= need_top1 - 1e-9
        if passed:
            reason = f"every {said} query's ranking within threshold ({bound})"
        elif not finite:
            reason = "int8 produced non-finite scores"
        elif lo < need_rho - 1e-9:
            reason = (f"{said} query {figures['worst_query']} has Spearman {lo:.4f} < {need_rho:.4f} "
                      f"(threshold {MIN_SPEARMAN}, {bound})")
        else:
            reason = (f"top-1 passage agrees on {top1:.4f} of {said} queries < {need_top1:.4f} "
                      f"(threshold {MIN_TOP1_AGREEMENT}, {bound})")
        return ScoreGateResult(passed, "rerank", float(figures["pearson"]), float(figures["pearson"]), MIN_SPEARMAN,
                               reason, order_preserved=passed, margin_factor=margin_factor,
                               measured_on=measured_on, min_spearman=lo, mean_spearman=float(figures["mean_spearman"]),
                               top1_agreement=top1, inputs=n)
    agree, diff, n = float(figures["label_agreement"]), float(figures["max_prob_diff"]), int(figures["inputs"])
    need_agree = _needed(agreement_bound(MIN_LABEL_AGREEMENT, margin_factor), n, round_down)
    allowed = MAX_PROB_DIFF / margin_factor
    passed = finite and agree >= need_agree - 1e-9 and diff <= allowed
    if passed:
        reason = f"labels and probabilities within threshold ({bound})"
    elif not finite:
        reason = "int8 produced non-finite logits"
    elif agree < need_agree - 1e-9:
        reason = (f"labels agree on {agree:.4f} of {said} inputs < {need_agree:.4f} (threshold "
                  f"{MIN_LABEL_AGREEMENT}, {bound})")
    else:
        reason = (f"{said} input {figures['worst_input']} moves a probability by {diff:.4f} > {allowed:.4f} "
                  f"(threshold {MAX_PROB_DIFF}, {bound})")
    return ScoreGateResult(passed, "classify", float(figures["min_cosine"]), float(figures["mean_cosine"]),
                           MIN_LABEL_AGREEMENT, reason, order_preserved=agree == 1.0, margin_factor=margin_factor,
                           measured_on=measured_on, label_agreement=agree, max_prob_diff=diff, inputs=n)


def probe_judge(figures: dict[str, Any]) -> ScoreGateResult:
    """A cached build's verdict on its probe: the thresholds themselves, no margin (the build passed the margin
    on the judged set it was built with; the probe only shows the weights on disk are still that build), and
    agreements counted in whole inputs."""
    return judge(figures, margin_factor=1.0, measured_on="probe", round_down=True)


def stored(gate: ScoreGateResult) -> ScoreGateResult:
    """A verdict taken from a cached build's file, marked so: nothing here measured its figures."""
    return replace(gate, measured_on="stored")


# -- the sets ----------------------------------------------------------------------------------------------------
def form_groups(texts: list[str], odd: list[str], stress: list[str], count: int, seed: int) -> Calibration:
    """`count` query groups from `texts` with a fixed seed: a query (the first third of one text's words; every
    eighth a degenerate one from `stress`) with that text, GROUP_SIZE - 2 other texts and one long or
    degenerate passage from `odd`. Long and degenerate inputs set the widest activations, as for embedders."""
    rng = random.Random(seed)
    queries, documents = [], []
    for g in range(count):
        own = texts[g % len(texts)]
        words = own.split()
        degenerate = stress[(g // 8) % len(stress)]
        query = degenerate if g % 8 == 7 else " ".join(words[: max(3, len(words) // 3)])
        others = rng.sample([t for t in texts if t != own], GROUP_SIZE - 2)
        queries.append(query)
        documents.append([own, *others, odd[g % len(odd)]])
    return Calibration([], queries, documents)


def probe_groups(judge_set: Calibration, count: int = PROBE_COUNT) -> Calibration:
    """`count` judged groups spread over length (words of query and passages): the shortest, the longest and
    evenly between, so the probe holds the file's short natural groups, degenerate queries and passages at
    the model's maximum length."""
    groups = list(zip(judge_set.queries, judge_set.documents, strict=True))
    by_length = sorted(groups, key=lambda g: (sum(len(t.split()) for t in [g[0], *g[1]]), g[0]))
    if len(by_length) > count:
        picks = dict.fromkeys(int(i) for i in np.linspace(0, len(by_length) - 1, count).round())
        by_length = [by_length[i] for i in picks]
    return Calibration([], [q for q, _ in by_length], [list(d) for _, d in by_length])


def rerank_sets(base: Calibration | None = None) -> ScoringSets:
    """The reranker's calibrate / judge / probe groups (module docstring)."""
    base = base or load_calibration()
    calibrate_texts, judge_texts = split_texts(list(base.texts))
    file_groups = list(zip(base.queries, base.documents, strict=True))
    made = form_groups(calibrate_texts, [*STRESS_TEXTS, *unrelated_passages(calibrate_texts)], STRESS_TEXTS,
                       EXTRA_GROUPS, GROUP_SEED)
    calibrate = Calibration([], [q for q, _ in file_groups[0::2]] + made.queries,
                            [list(d) for _, d in file_groups[0::2]] + made.documents)
    judge_odd = [*JUDGE_STRESS_TEXTS, *unrelated_passages(judge_texts, seed=JUDGE_UNRELATED_SEED)]
    judged = form_groups(judge_texts, judge_odd, JUDGE_STRESS_TEXTS, EXTRA_GROUPS, GROUP_SEED + 1)
    taken = set(calibrate.queries) | {d for docs in calibrate.documents for d in docs}
    kept = [(q, list(d)) for q, d in [*file_groups[1::2], *zip(judged.queries, judged.documents, strict=True)]
            if q not in taken and not taken & set(d)]
    judge_set = Calibration([], [q for q, _ in kept], [d for _, d in kept])
    return ScoringSets(calibrate, judge_set, probe_groups(judge_set))


def classify_sets(tokenizer: Path | None, max_length: int, base: Calibration | None = None) -> ScoringSets:
    """The classifier's calibrate / judge / probe texts: the embedder gate's (int8_gate.int8_sets)."""
    sets = int8_sets(tokenizer, max_length, base)
    return ScoringSets(*(Calibration(list(texts), [], []) for texts in (sets.calibrate, sets.judge, sets.probe)))


def scoring_sets(task: str, tokenizer: Path | None = None, max_length: int = 512) -> ScoringSets:
    """What a reranker or classifier is quantised on, judged on and probed with."""
    return rerank_sets() if task == "rerank" else classify_sets(tokenizer, max_length)


def sets_digest(sets: ScoringSets) -> str:
    """sha256 (16 hex digits) of the texts a build depends on: another set is another build."""
    return hashlib.sha256(json.dumps(sets.digest_parts()).encode()).hexdigest()[:16]

