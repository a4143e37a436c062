"""The drift gate: may a new revision's vectors stand in for the old one's?

Two revisions' outputs on the canonical probe set are compared the way an index would notice a change:

- embedders (`embed`, `sparse`, `multivector`: one vector per probe text): every text's new vector must
  keep a cosine of at least `min_cosine` with its old vector (0.999 by default, the FP8 gate's bar), and the
  rank order of the probe's pairwise similarities must hold, since a retrieval result is an order;
- rerankers and classifiers (`rerank`, `classify`: one score row per probe query or text): the same top-1
  in every row and the same order of the rest. Their cosine is reported but does not gate: logits move with
  dtype while the ranking a user sees does not.

An order counts as kept when no two items whose old scores were clearly apart (further than `margin`) swap;
near-ties may swap, as they do between two runs of one model in a lower precision.

Pure numpy, no model code: the runtime (periodic drift check), the operator (candidate gate) and the hub
(per-wave gate) call the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

EMBEDDING_TASKS = ("embed", "sparse", "multivector")
SCORE_TASKS = ("rerank", "classify")
DEFAULT_MIN_COSINE = 0.999


@dataclass(frozen=True)
class ProbeOutputs:
    """One revision's outputs on the probe set: `task` and one row per probe text (or query)."""

    task: str
    outputs: np.ndarray
    probe_set: str = ""

    @classmethod
    def of(cls, task: str, outputs: Sequence[Sequence[float]] | np.ndarray, probe_set: str = "") -> ProbeOutputs:
        return cls(task, np.asarray(outputs, dtype=np.float64), probe_set)

    @classmethod
    def from_json(cls, body: dict) -> ProbeOutputs:
        """From a runtime's GET /v1/models/{model}/probe answer (or a stored copy of one)."""
        return cls.of(body["task"], body["outputs"], body.get("probe_set", ""))


@dataclass(frozen=True)
class GateResult:
    passed: bool
    min_cosine: float | None
    mean_cosine: float | None
    order_kept: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def message(self) -> str:
        """One line naming the measured drift (what RolloutBlocked and Degraded conditions say)."""
        cos = "n/a" if self.min_cosine is None else f"{self.min_cosine:.6f}"
        mean = "n/a" if self.mean_cosine is None else f"{self.mean_cosine:.6f}"
        head = f"probe min cosine {cos} (mean {mean}), order {'kept' if self.order_kept else 'changed'}"
        return head + ("" if self.passed else ": " + "; ".join(self.reasons))

    def as_status(self) -> dict:
        return {"passed": self.passed, "minCosine": self.min_cosine, "meanCosine": self.mean_cosine,
                "orderKept": self.order_kept, "message": self.message}


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms == 0, 1.0, norms)


def row_cosines(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Cosine of each old row with the same new row (a zero row has cosine 0 with anything)."""
    return np.sum(_unit(old) * _unit(new), axis=1)


def order_swaps(old: np.ndarray, new: np.ndarray, margin: float) -> int:
    """How many pairs (i, j) with old[i] > old[j] + margin come out new[i] <= new[j]: clear inversions."""
    old, new = np.asarray(old, dtype=np.float64).ravel(), np.asarray(new, dtype=np.float64).ravel()
    clearly_above = (old[:, None] - old[None, :]) > margin
    not_above = (new[:, None] - new[None, :]) <= 0
    return int(np.count_nonzero(clearly_above & not_above))


def _similarities(rows: np.ndarray) -> np.ndarray:
    unit = _unit(rows)
    sims = unit @ unit.T
    upper = np.triu_indices(len(rows), k=1)
    return sims[upper]


def _normalised(row: np.ndarray) -> np.ndarray:
    """A score row scaled to [0, 1] so one margin fits logits and probabilities alike."""
    span = float(np.ptp(row))
    return (row - row.min()) / span if span > 0 else np.zeros_like(row)


def compare(old: ProbeOutputs, new: ProbeOutputs, min_cosine: float = DEFAULT_MIN_COSINE) -> GateResult:
    """The gate. `margin` for order follows the cosine bar: vectors within `min_cosine` of each other move a
    similarity by at most about 2(1 - min_cosine), so only gaps wider than that must keep their order."""
    reasons: list[str] = []
    if old.task != new.task:
        return GateResult(False, None, None, False, [f"task changed from {old.task!r} to {new.task!r}"])
    if old.probe_set and new.probe_set and old.probe_set != new.probe_set:
        return GateResult(False, None, None, False,
                          [f"probe sets differ ({old.probe_set} vs {new.probe_set}): outputs are not comparable"])
    if old.outputs.shape != new.outputs.shape:
        return GateResult(False, None, None, False,
                          [f"output shape changed from {old.outputs.shape} to {new.outputs.shape}"])
    if old.outputs.ndim != 2 or len(old.outputs) == 0:
        return GateResult(False, None, None, False, ["no probe outputs to compare"])
    cosines = row_cosines(old.outputs, new.outputs)
    low, mean = float(cosines.min()), float(cosines.mean())
    margin = max(2e-3, 2 * (1 - min_cosine))
    if old.task in SCORE_TASKS:
        top_changed = [i for i in range(len(old.outputs))
                       if int(np.argmax(old.outputs[i])) != int(np.argmax(new.outputs[i]))]
        swaps = sum(order_swaps(_normalised(o), _normalised(n), margin)
                    for o, n in zip(old.outputs, new.outputs, strict=True))
        if top_changed:
            reasons.append(f"top-1 changed on probe row(s) {top_changed[:8]}")
        if swaps:
            reasons.append(f"{swaps} clear order inversion(s) among the scores")
        return GateResult(not reasons, low, mean, swaps == 0, reasons)
    if low < min_cosine:
        worst = int(np.argmin(cosines))
        reasons.append(f"probe text {worst} moved to cosine {low:.6f} < minCosine {min_cosine}")
    swaps = order_swaps(_similarities(old.outputs), _similarities(new.outputs), margin)
    if swaps:
        reasons.append(f"{swaps} clear inversion(s) in the order of the probe's pairwise similarities")
    return GateResult(not reasons, low, mean, swaps == 0, reasons)
