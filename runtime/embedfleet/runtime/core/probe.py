"""The canonical probe set's outputs, the fingerprint taken from them, and a stored reference: pure numpy.

What each task's probe row is (one row per probe text, or per rerank probe query):

- `embed`: the L2-normalised embedding of each probe text (what an index stores);
- `sparse`: a dense summary of each text's SPLADE weights, the weights summed into SPARSE_BUCKETS slots by
  token id modulo SPARSE_BUCKETS. The full vocabulary row (30k floats a text, ~6 MB of JSON for the probe)
  is too big to serve and store; folded, a weight that moves still moves its slot, and two revisions'
  folds compare by cosine like dense vectors;
- `multivector`: the mean of each text's unit token vectors, normalised (one vector a text, so the drift
  gate's per-row cosine and pair order apply as for dense models);
- `rerank`: one row per rerank probe query: the raw relevance score (logit) of each of its documents, raw
  so that saturation in a sigmoid cannot hide a change of order;
- `classify`: the label probabilities of each probe text (softmax; sigmoid for a one-label model).

The fingerprint hashes the probe set's version, the task and the outputs rounded to 4 decimals (as
little-endian float32): two starts of one model on one machine give the same fingerprint, any change of
weights, tokenizer or pooling a different one. It names a revision; the drift gate (compat.gate) decides
whether two revisions are interchangeable.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from embedfleet.compat.gate import ProbeOutputs
from embedfleet.runtime.core.scores import label_scores, relevance

SPARSE_BUCKETS = 4096
FINGERPRINT_DECIMALS = 4


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


def embed_rows(pooled: np.ndarray) -> np.ndarray:
    """Pooled vectors as the embedding routes serve them by default: unit length."""
    return _unit(pooled)


def sparse_rows(weights: np.ndarray, buckets: int = SPARSE_BUCKETS) -> np.ndarray:
    """Vocabulary-wide SPLADE rows folded into `buckets` slots: slot j sums the weights of token ids
    congruent to j modulo `buckets`."""
    weights = np.asarray(weights, dtype=np.float32)
    width = -(-weights.shape[1] // buckets) * buckets
    padded = np.zeros((weights.shape[0], width), dtype=np.float32)
    padded[:, : weights.shape[1]] = weights
    return padded.reshape(weights.shape[0], width // buckets, buckets).sum(axis=1)


def multivector_rows(per_token: Sequence[np.ndarray]) -> np.ndarray:
    """Each text's token vectors averaged, then normalised."""
    return _unit(np.stack([np.asarray(v, dtype=np.float32).mean(axis=0) for v in per_token]))


def rerank_rows(logits: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """Raw relevance per (query, document) pair, cut into one row per probe query (`counts`: documents
    of each query, in order). Every probe query has as many documents, so the rows form a matrix."""
    if len(set(counts)) != 1:
        raise ValueError(f"the rerank probes must have equally many documents each, got {list(counts)}")
    scores = relevance(np.asarray(logits, dtype=np.float32), raw=True)
    return scores.reshape(len(counts), counts[0])


def classify_rows(logits: np.ndarray) -> np.ndarray:
    """Label probabilities per text, as /classify answers by default."""
    return label_scores(np.asarray(logits, dtype=np.float32), raw=False, multi_label=False)


def fingerprint(version: str, task: str, outputs: np.ndarray) -> str:
    """`sha256:<hex>` over the probe set version, the task and the outputs rounded to 4 decimals as
    little-endian float32 (`+ 0.0` folds -0.0 into 0.0, whose bytes differ)."""
    rounded = np.round(np.asarray(outputs, dtype=np.float64), FINGERPRINT_DECIMALS) + 0.0
    h = hashlib.sha256()
    h.update(version.encode())
    h.update(b"\0")
    h.update(task.encode())
    h.update(b"\0")
    h.update(np.ascontiguousarray(rounded, dtype="<f4").tobytes())
    return "sha256:" + h.hexdigest()


def weights_space(digest: str) -> str:
    """The vector space of a runtime that was given neither --vector-space nor --revision: `weights-` and the
    first 12 hex digits of the model directory's digest. Named after the weights, not the probe outputs:
    two processes of one model can round a probe value apart (seen: their fingerprints differed), and
    replicas of the same files must land in one space."""
    return "weights-" + digest.removeprefix("sha256:")[:12]


class BadReference(ValueError):
    """A --probe-reference file that cannot serve as a reference (the message says why)."""


def load_reference(path: Path, version: str) -> ProbeOutputs:
    """A stored GET /v1/models/{model}/probe answer: task, probe_set and outputs (a non-empty matrix of
    finite numbers). Outputs of another probe set version are refused: they are not comparable."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadReference(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadReference(f"{path} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BadReference(f"{path} must hold a JSON object as GET /v1/models/MODEL/probe returns it")
    task = raw.get("task")
    if task not in ("embed", "sparse", "multivector", "rerank", "classify"):
        raise BadReference(f"{path}: `task` must be embed, sparse, multivector, rerank or classify, not {task!r}")
    probe_set = raw.get("probe_set")
    if probe_set != version:
        raise BadReference(f"{path} holds outputs of probe set {probe_set!r}, this runtime's is {version!r}: "
                              "not comparable; take the reference from a runtime of this version")
    outputs = raw.get("outputs")
    if (not isinstance(outputs, list) or not outputs or not all(isinstance(r, list) and r for r in outputs)
            or len({len(r) for r in outputs}) != 1):
        raise BadReference(f"{path}: `outputs` must be a non-empty list of equally long, non-empty rows")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
               for row in outputs for x in row):
        raise BadReference(f"{path}: `outputs` must hold finite numbers only")
    return ProbeOutputs.of(task, outputs, probe_set)


def probe_body(model: str, revision: str, vector_space: str, fp: str, outputs: ProbeOutputs) -> dict:
    """GET /v1/models/{model}/probe, and the shape a --probe-reference file holds."""
    return {"model": model, "revision": revision, "vector_space": vector_space, "fingerprint": fp,
            "probe_set": outputs.probe_set, "task": outputs.task,
            "outputs": np.asarray(outputs.outputs, dtype=np.float32)}
