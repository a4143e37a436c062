"""int8 on CPU for rerankers and sequence classifiers: the same OpenVINO + NNCF build as the embedders'
(engines/int8_cpu.py: same recipe, cached by model digest in the CPU class's folder under the same build
lock), judged on what these models serve: rankings, labels and probabilities (engines/int8_scoring_gate.py
says how, on which sets and with which margins).

Start-up: float32 loads, the model is quantised on the calibrate set and judged against float32 on the judge
set, which shares no query, passage or text with it; the verdict needs the thresholds less a margin. The
build and its judged figures are cached; a later start does not quantise, but it does not trust the stored
figures either (the folder is writable by the tenant's pod): it loads float32 and judges the cached build again
on the probe (a part of the judge set) with the thresholds themselves. A build that fails its probe is built
again in place and judged in full, as an embedder's is (engines/int8_cpu.py build_once); stored figures that
refuse int8 are taken as they are (a refusal serves no int8). The engine's `int8_gate` is always what this
process measured (judged set or probe), and that is what /v1/models reports.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
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
    STORED_NOTE,
    CacheKey,
    Int8Rejected,
    build_once,
    fallback_engine,
    no_telemetry,
    quantize_module,
    refusal,
    stored_verdict,
    unreadable,
)
from embedfleet.runtime.engines.int8_scoring_gate import (
    ScoreGateResult,
    ScoringSets,
    judge,
    measure,
    probe_judge,
    scoring_sets,
    sets_digest,
    stored,
)
from embedfleet.runtime.engines.quality_gate import GateResult, calibration_batches, run_calibration
from embedfleet.runtime.engines.torch_engine import EngineError, TorchEngine
from embedfleet.runtime.models.spec import ModelSpec

log = logging.getLogger(__name__)

# The head (BERT's pooler and classifier, RoBERTa's dense and out_proj: two MatMuls on one vector per input)
# stays float32: it costs nothing next to the encoder, and int8 there rounds the served score itself.
HEAD_MATMULS = 2
# v2: quantised on the calibrate set, judged on a disjoint judge set with a margin (v1 judged its own)
SCORING_RECIPE = f"{RECIPE}-scoring-v2"


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
                              sets: ScoringSets | None = None,
                              fallback: Callable[[], TorchEngine] | None = None) -> Int8ScoringEngine | TorchEngine:
    """The int8 engine if the gate passes; otherwise Int8Rejected (strict) or the float32 torch engine,
    whose `int8_gate` carries the refused measurement. Cached by model digest like the embedders' build.
    `sets` defaults to `scoring_sets` for the model."""
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
    sets = sets or scoring_sets(spec.task, spec.path / "tokenizer.json", spec.max_length)
    key = CacheKey(spec.digest, f"{SCORING_RECIPE}-{spec.task}", ov.__version__, nncf.__version__, sets_digest(sets))
    manifest, source, fp32, probed = build_once(
        spec, key, cache_root, num_threads, lambda fp32, path: _build(fp32, spec, key, path, sets, num_threads),
        check=lambda found, path, load_fp32: _probe(found, path, load_fp32, spec, sets, num_threads))
    # what decides and what /v1/models reports is what this process measured: the judged set of a build it
    # made, the probe of a cached one; a cached refusal is taken as stored, and marked so
    gate: GateResult = probed if probed is not None else \
        judge(manifest["figures"], measured_on="judge") if source.source == "built" else \
        stored(judge(manifest["figures"]))
    if gate.passed:
        log.info("%s: %s", spec.name, gate.summary())
        served = Int8ScoringEngine(spec, source.path / "model.xml", gate, num_threads)
        served.build_source = source
        return served
    summary = gate.summary() + STORED_NOTE * (gate.measured_on == "stored")
    if strict:
        raise Int8Rejected(f"{summary}; the server will not start (serve --dtype float32, or pass "
                           "--no-int8-strict to serve float32 when int8 is refused)")
    log.warning("%s: %s; serving float32 (--no-int8-strict)", spec.name, summary)
    fp32 = None if fallback is not None else fp32  # freed before the settings' float32 engine loads
    engine = fallback_engine(fp32, fallback, spec, num_threads)
    engine.int8_gate = gate
    engine.build_source = source  # the int8 build was made (or found) and judged, though float32 serves
    return engine


def _probe(manifest: dict[str, Any], path: Path, load_fp32: Callable[[], TorchEngine], spec: ModelSpec,
           sets: ScoringSets, num_threads: int) -> GateResult | None:
    """A cached build judged again on the probe against float32 before it may serve: the verdict this process
    measured (probe_judge). Its stored figures decide nothing here: the folder is writable by the tenant's pod,
    so figures that pass prove nothing. Figures that refuse are taken as they are (None: no probe): a refusal
    serves no int8, so a forged one can only keep int8 from serving, never let a bad build serve."""
    verdict = stored_verdict(manifest, lambda m: judge(m["figures"]))
    if verdict is None:
        return unreadable(spec.task)
    if not verdict.passed:
        return None
    fp32 = load_fp32()
    started = time.perf_counter()
    batches = calibration_batches(spec, sets.probe)
    try:
        candidate = run_calibration(Int8ScoringEngine(spec, path / "model.xml", None, num_threads).classify, batches)
    except Exception as exc:  # a build that does not load or run is a failed build, not a failed start
        return replace(unreadable(spec.task), reason=f"it does not run ({type(exc).__name__}: {str(exc)[:200]})")
    reference = run_calibration(fp32.classify, batches)
    try:
        gate: ScoreGateResult = probe_judge(measure(spec.task, reference, candidate, sets.probe))
    except ValueError as exc:  # another model's build: another output shape
        return replace(unreadable(spec.task), reason=f"its outputs do not match float32's ({exc})")
    if gate.passed:
        log.info("%s: the cached int8 build passed its re-judgement on %d probe inputs in %.2fs: %s", spec.name,
                 gate.inputs, time.perf_counter() - started, gate.summary())
    return gate


def _build(fp32: TorchEngine, spec: ModelSpec, key: CacheKey, path: Path, sets: ScoringSets,
           num_threads: int) -> dict[str, Any]:
    """Quantise on the calibrate set, score the judge set (none of it calibrated on) in both precisions, and
    publish the build atomically (a temporary folder renamed into place)."""
    started = time.perf_counter()
    calibrate = calibration_batches(spec, sets.calibrate)
    judged = calibration_batches(spec, sets.judge)
    reference = run_calibration(fp32.classify, judged)
    segments, pad = uses_segments(spec), spec.pad_token_id
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        quantize_module(_Scored(fp32.model, segments), [[feeds([x], pad, segments) for x in b] for b in calibrate],
                        feeds(calibrate[0][:2], pad, segments), tmp, keep_last=HEAD_MATMULS)
        candidate = run_calibration(Int8ScoringEngine(spec, tmp / "model.xml", None, num_threads).classify, judged)
        figures = measure(spec.task, reference, candidate, sets.judge)
        manifest = {"key": asdict(key), "figures": figures, "calibrated_on": sum(len(b) for b in calibrate),
                    "seconds": round(time.perf_counter() - started, 2)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("%s: int8 built in %.1fs into %s", spec.name, manifest["seconds"], path)
    return manifest
