"""int8 on CPU (`--dtype int8`): an OpenVINO int8 build of an encoder embedder, kept only if it passes the
quality gate.

Why OpenVINO: measured side by side on the embedded all-MiniLM-L6-v2 (bench/int8_backends.py,
docs/performance.md), PyTorch's dynamic int8 and ONNX Runtime's dynamic or static int8 either lost too
much (cosine with float32 down to 0.80-0.97) or gained too little once the sensitive layers stayed float32;
OpenVINO with NNCF's post-training quantisation (SmoothQuant, calibrated activation ranges, per-channel
weights) ran ~2.3x float32 PyTorch; its held-out vectors reach cosine 0.9895 at worst on unseen text
(bench/int8_margin.py), which sets the default --int8-min-cosine of 0.985.

The recipe keeps float32 where int8 hurts: matrix products between two activations (attention scores
and the weighted sum of values: no weights to calibrate, ranges that move with every input) and the FFN's
second linear layer (its input is a GELU output, a long-tailed range a per-tensor scale cannot cover).
Everything else (Q/K/V, the attention output and the FFN's first linear layer) runs int8.

Start-up: the float32 model is loaded, converted, quantised on one set of texts and judged on another,
disjoint one (engines/int8_gate.py: halves of engines/calibration.json, degenerate repetitions, long passages
of unrelated and of rare vocabulary words): every judged embedding's cosine with its float32 twin must reach
--int8-min-cosine less a margin (INT8_MARGIN_FACTOR), as for FP8. The result (the int8 model and the judged
figures) is cached by model digest under --engine-cache-dir, so the second start does not quantise; it judges
the cached build again on a few probe texts against the float32 model before serving it, because the
folder is writable by the tenant's pod and a stored verdict proves nothing. A build that fails its probe is
built again (and judged in full). The gate result an engine carries, and /v1/models reports, is always what
this process measured (GateResult.measured_on: the judged set of a build it made, the probe of a cached one).
Builds are kept per CPU class
(``<engine cache dir>/<cpu class>/sha256-<digest>/int8-cpu-<hash>``, engines/cache_dir.py `engine_root`): a
verdict holds on the class of processor it was measured on.
Rerankers and sequence classifiers are built the same way and judged on scores, rankings and labels
instead of cosines (engines/int8_scoring.py, chosen by task in service.py).
Refused: decoders, encoder families outside INT8_FAMILIES (named in the message), sparse and multi-vector
models, any device but CPU, and any model the gate fails.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedfleet.operator.cache.engines import cpu_accelerator  # stdlib only
from embedfleet.runtime.engines.base import Capabilities, pad_batch
from embedfleet.runtime.engines.cache_dir import BuildSource, build_lock, build_source, check_part, engine_root
from embedfleet.runtime.engines.int8_gate import (
    STRESS_TEXTS,
    Int8Sets,
    int8_sets,
    probe_verdict,
    unrelated_passages,
    verdict,
)
from embedfleet.runtime.engines.quality_gate import (
    Calibration,
    GateResult,
    calibration_batches,
    load_calibration,
    row_cosines,
    run_calibration,
)
from embedfleet.runtime.engines.torch_engine import EngineError, TorchEngine, pool
from embedfleet.runtime.models.spec import ModelSpec

log = logging.getLogger(__name__)

DEFAULT_MIN_COSINE = 0.985  # with INT8_MARGIN_FACTOR the judged set must reach 0.99 (engines/int8_gate.py)
RECIPE = "ov-nncf-v2"  # bump when the quantisation recipe changes: old cache entries are then ignored
MANIFEST = "int8.json"
# said after a verdict taken from a cached build's file (a refusal: taken as it is, but measured by no one here)
STORED_NOTE = "; figures as stored with the cached build, not measured by this process"
INSTALL_HINT = ("--dtype int8 needs the `openvino` and `nncf` packages (the runtime extra: "
                "pip install 'embedfleet[runtime]'); or serve --dtype float32")


def no_telemetry() -> None:
    """Keep OpenVINO's and NNCF's usage telemetry from ever loading (call before importing either).

    Both report usage to Google Analytics by default: ``ov.convert_model`` (openvino/tools/ovc) and
    ``nncf.quantize`` build an ``openvino_telemetry.Telemetry`` with the opt-in dialog off, which counts a
    missing consent file as consent. A runtime pod must make no outbound call of its own, and a read-only
    pod has no home directory to hold a "declined" file. Both fall back to their own stubs when
    ``openvino_telemetry`` cannot be imported, and a ``None`` entry in ``sys.modules`` makes every import of
    it fail, so nothing is sent and nothing tries to connect (tests/runtime/test_int8_cpu.py checks the
    stubs are what runs)."""
    loaded = sys.modules.get("openvino_telemetry", None)
    if loaded is not None:
        log.warning("openvino_telemetry was imported before the int8 engine could block it")
        return
    sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]


def int8_calibration() -> Calibration:
    """calibration.json's texts plus STRESS_TEXTS (engines/int8_gate.py) and long unrelated-word passages:
    what a classifier's int8 build is calibrated on and judged by (engines/int8_scoring.py)."""
    base = load_calibration()
    return Calibration([*base.texts, *STRESS_TEXTS, *unrelated_passages(base.texts)], base.queries, base.documents)


class Int8Rejected(EngineError):
    """int8 failed the quality gate (or cannot serve this model) and no fallback was allowed."""


# Encoder families (config.json's model_type) the recipe is verified on: each is converted, quantised and
# judged in tests/runtime/test_int8_families.py. Any other family is refused by name rather than quantised
# on trust: the MatMuls kept float32 are found by graph shape, which another attention layout may not match.
INT8_FAMILIES = {"bert": "BERT", "roberta": "RoBERTa", "xlm-roberta": "XLM-R"}
# Families the runtime knows but int8 refuses, with why (said in the refusal).
REFUSED_FAMILIES = {
    "mpnet": ("MPNet", "not verified: the recipe finds the MatMuls it keeps float32 by graph shape, and MPNet's "
                       "relative-position attention was not checked against it (a tiny random MPNet built and "
                       "judged reached cosine 0.986 only)"),
}
INT8_TASKS = ("embed", "rerank", "classify")


def refusal(spec: ModelSpec, device: str) -> str | None:
    """Why int8 cannot serve `spec` on `device`, or None. Encoders of INT8_FAMILIES pass for embedding,
    reranking and classification: decoders' long-tailed activations are outside what the recipe was
    measured on, and sparse/multi-vector outputs have no gate here."""
    served = ", ".join(INT8_FAMILIES.values())
    if device != "cpu":
        return f"--dtype int8 is a CPU precision; on {device} use --dtype fp8 (quality-gated) or bfloat16"
    if spec.is_decoder:
        return (f"--dtype int8 serves encoders ({served} families); {spec.name} is a "
                f"decoder ({spec.model_type}): serve it --dtype float32 or bfloat16")
    if spec.task not in INT8_TASKS:
        return (f"--dtype int8 serves embedders, rerankers and classifiers; {spec.name} is a {spec.task} model, "
                "which no int8 gate judges: serve it --dtype float32 or bfloat16")
    if spec.model_type not in INT8_FAMILIES:
        family, why = REFUSED_FAMILIES.get(spec.model_type, (spec.model_type or "unknown", "not verified"))
        return (f"--dtype int8 serves the {served} encoder families; {spec.name} is of the {family} family "
                f"({spec.model_type}), which it refuses: {why}. Serve it --dtype float32")
    return None


@dataclass(frozen=True)
class CacheKey:
    """Everything the int8 model depends on; another value in any field means another build."""

    model_digest: str
    recipe: str
    openvino: str
    nncf: str
    calibration: str  # sha256 of the calibration set: the gate's verdict depends on it

    def dirname(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"int8-cpu-{hashlib.sha256(blob).hexdigest()[:16]}"


def calibration_digest(calibration: Calibration | Int8Sets) -> str:
    """The texts a build depends on: a Calibration's, or an Int8Sets' calibrate, judge and probe texts."""
    texts = calibration.texts if isinstance(calibration, Calibration) else \
        [calibration.calibrate, calibration.judge, calibration.probe]
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]


def cache_path(engines: Path, key: CacheKey) -> Path:
    """The build's folder under `engines` (an accelerator folder, `engine_root`): by model digest alone, so
    the same weights served under another name reuse the build."""
    digest = key.model_digest.replace("sha256:", "")[:16] or "nodigest"
    return engines / check_part(f"sha256-{digest}") / check_part(key.dirname())


def read_cached(path: Path, key: CacheKey) -> dict[str, Any] | None:
    """The manifest of a finished build for exactly `key` (model files and the gate's figures), else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("key") == asdict(key) and (path / "model.xml").exists() else None


#: (its manifest, where it came from, the float32 engine when the call loaded one, the re-judgement of a cached
#: build: None for a build made by this call or a cached refusal taken as stored)
Built = tuple[dict[str, Any], BuildSource, "TorchEngine | None", "GateResult | None"]
#: Judges a cached build again before it is trusted: (its manifest, its folder, a loader of the float32 engine)
#: -> the verdict this process measured (passed: the build serves; failed: it is built again), or None when the
#: stored figures refuse int8 and are taken as they are (a refusal serves no int8).
Check = Callable[[dict[str, Any], Path, Callable[[], TorchEngine]], "GateResult | None"]


def build_once(spec: ModelSpec, key: CacheKey, cache_root: Path | None, num_threads: int,
               build: Callable[[TorchEngine, Path], dict[str, Any]], check: Check | None = None) -> Built:
    """The int8 build `key` names, made by `build(float32 engine, folder)` only when no complete one is cached
    in this CPU class's folder: replicas starting together on one node take the build lock, so one builds and
    the others wait and read its result. A cached build is judged again by `check` (when given) before it is
    returned; one that fails is built again, in its place, with a warning saying why. Returns (its manifest,
    where it came from and its folder, the float32 engine when this call loaded one, the cached build's
    re-judgement)."""
    path = cache_path(engine_root(cache_root, spec.path, cpu_accelerator()), key)
    fp32: TorchEngine | None = None
    probed: GateResult | None = None

    def load_fp32() -> TorchEngine:
        nonlocal fp32
        # transformers' modules: the int8 build is exported from them, and judged against them
        fp32 = fp32 or TorchEngine(spec, dtype="float32", num_threads=num_threads, native=False)
        return fp32

    def trusted(found: dict[str, Any] | None) -> dict[str, Any] | None:
        nonlocal probed
        if found is None or check is None:
            return found
        probed = check(found, path, load_fp32)
        if probed is None or probed.passed:
            return found
        log.warning("%s: the cached int8 build at %s fails its re-judgement (%s); building it again",
                    spec.name, path, probed.reason)
        probed = None
        return None

    found = read_cached(path, key)
    manifest = trusted(found)
    built = False
    if manifest is None:
        with build_lock(path):
            again = read_cached(path, key)
            # another replica may have built (or rebuilt) it while this one waited: judge that one too
            manifest = trusted(again) if again != found else None
            if manifest is None:
                manifest = build(load_fp32(), path)
                built = True
    return manifest, build_source(path, built), fp32, probed


def stored_verdict(manifest: dict[str, Any], judge: Callable[[dict[str, Any]], GateResult]) -> GateResult | None:
    """`judge` of a cached manifest's stored figures, or None when they cannot be read (missing or mistyped
    fields: a file nobody here wrote, judged like a build that fails its re-judgement)."""
    try:
        return judge(manifest)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def unreadable(task: str) -> GateResult:
    """The failed re-judgement of a cached build whose stored figures cannot be read: it is built again."""
    return GateResult(False, task, 0.0, 0.0, 0.0, "its stored figures cannot be read", measured_on="probe")


class _Pooled(torch.nn.Module):
    """The encoder plus the model's pooling, so the int8 graph returns the served vector (float32)."""

    def __init__(self, model: torch.nn.Module, pooling: str) -> None:
        super().__init__()
        self.model, self.pooling = model, pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return pool(hidden, attention_mask, self.pooling)


def _feeds(batch: list, pad_id: int) -> dict[str, np.ndarray]:
    padded = pad_batch(batch, pad_id)
    return {"input_ids": padded.ids, "attention_mask": padded.mask}


def _source(node: Any) -> Any:
    """The node feeding `node`'s first input, looking through the casts and reshapes around constants."""
    return node.input_value(0).get_node()


def _is_weight(node: Any) -> bool:
    """True when `node` is a constant, possibly behind Convert/Transpose/Reshape (a linear layer's weight)."""
    for _ in range(4):
        kind = node.get_type_name()
        if kind == "Constant":
            return True
        if kind not in ("Convert", "Transpose", "Reshape", "Multiply", "Subtract"):
            return False
        node = _source(node)
    return False


def kept_float(ov_model: Any) -> list[str]:
    """Names of the MatMuls the recipe keeps float32: those without a constant weight (attention scores and
    values) and those whose input comes from a GELU (the FFN's second linear layer)."""
    names = []
    for node in ov_model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        a, b = (node.input_value(i).get_node() for i in range(2))
        if not (_is_weight(a) or _is_weight(b)):
            names.append(node.get_friendly_name())
            continue
        activation = b if _is_weight(a) else a
        for _ in range(3):  # Gelu, maybe behind a reshape
            if activation.get_type_name() == "Gelu":
                names.append(node.get_friendly_name())
                break
            if activation.get_type_name() not in ("Reshape", "Convert"):
                break
            activation = _source(activation)
    return names


def quantize(fp32: TorchEngine, batches: list[list], out: Path, keep_float: bool = True) -> None:
    """Convert the float32 engine's model to OpenVINO, quantise it on the calibration batches (one text per
    sample: per-text ranges), and save the int8 IR as out/model.xml. `keep_float=False` quantises every
    MatMul NNCF would (the bench's comparison row), not the recipe's."""
    pad = fp32.spec.pad_token_id
    quantize_module(_Pooled(fp32.model, fp32.spec.pooling), [[_feeds([x], pad) for x in b] for b in batches],
                    _feeds(batches[0][:2], pad), out, keep_float)


def quantize_module(module: torch.nn.Module, samples: list[list[dict[str, np.ndarray]]],
                    example: dict[str, np.ndarray], out: Path, keep_float: bool = True, keep_last: int = 0) -> None:
    """The recipe on any traced module: convert with `example`, quantise on `samples` (batches of one-input
    feeds), keep the recipe's MatMuls float32 and also the last `keep_last` MatMuls (a classification head),
    save out/model.xml. Shared with engines/int8_scoring.py."""
    no_telemetry()
    import nncf
    import openvino as ov

    logging.getLogger("nncf").setLevel(logging.WARNING)  # one INFO line per layer it leaves float32
    with torch.inference_mode():
        model = ov.convert_model(module.eval(), example_input={k: torch.from_numpy(v) for k, v in example.items()})
    flat = [feed for batch in samples for feed in batch]
    names = kept_float(model) if keep_float else []
    if keep_last:
        names += [n.get_friendly_name() for n in model.get_ordered_ops() if n.get_type_name() == "MatMul"][-keep_last:]
    scope = nncf.IgnoredScope(names=names, validate=False)
    with contextlib.redirect_stdout(io.StringIO()):  # NNCF draws progress bars on stdout
        quantized = nncf.quantize(model, nncf.Dataset(flat), model_type=nncf.ModelType.TRANSFORMER,
                                  subset_size=len(flat), ignored_scope=scope)
    ov.save_model(quantized, str(out / "model.xml"))


class Int8CpuEngine:
    """Serves an encoder embedder from its cached OpenVINO int8 build (the Engine protocol, embed only)."""

    fp8_gate: GateResult | None = None
    preemptible = False  # one OpenVINO call per batch: nothing to pause between layers
    build_source: BuildSource | None = None  # where the build came from (set by build_int8_engine)

    def __init__(self, spec: ModelSpec, model_xml: Path, gate: GateResult, num_threads: int) -> None:
        no_telemetry()
        import openvino as ov

        self.spec = spec
        self.effective_dtype = "int8"
        self.int8_gate: GateResult | None = gate
        config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
        if num_threads > 0:
            config["INFERENCE_NUM_THREADS"] = num_threads
        self._compiled = ov.Core().compile_model(str(model_xml), "CPU", config)
        self._request = self._compiled.create_infer_request()
        self.capabilities = Capabilities(tasks=("embed",), pooling=spec.pooling, max_tokens=spec.max_length,
                                         dtypes=("int8",), device="cpu", dim=spec.output_dim)

    def warmup(self) -> None:
        token = self.spec.pad_token_id + 1
        self.embed([[token] * 8, [token] * 3])

    def embed(self, batch: list) -> np.ndarray:
        out = self._request.infer(_feeds(batch, self.spec.pad_token_id))
        return np.array(out[0], dtype=np.float32)[: len(batch)]

    def _unsupported(self, batch: list) -> Any:
        raise EngineError("the int8 CPU engine serves embeddings only")

    classify = embed_sparse = embed_tokens = _unsupported


def build_int8_engine(spec: ModelSpec, *, num_threads: int, min_cosine: float = DEFAULT_MIN_COSINE,
                      strict: bool = True, cache_root: Path | None = None,
                      sets: Int8Sets | None = None,
                      fallback: Callable[[], TorchEngine] | None = None) -> Int8CpuEngine | TorchEngine:
    """The int8 engine if the gate passes; otherwise Int8Rejected (strict) or the float32 torch engine, whose
    `int8_gate` then carries the refused measurement. `sets` defaults to `int8_sets` for the model; `fallback`
    makes that float32 engine (the server's, from its settings; default `fallback_engine`'s)."""
    why = refusal(spec, "cpu")
    if why:
        raise Int8Rejected(why)
    if spec.task != "embed":
        raise Int8Rejected(f"{spec.name} is a {spec.task} model: its int8 build is judged on scores "
                           "(engines/int8_scoring.py build_int8_scoring_engine), not embedding cosines")
    try:
        no_telemetry()
        import nncf
        import openvino as ov
    except ImportError as exc:
        raise EngineError(f"{INSTALL_HINT} ({exc})") from None

    sets = sets or int8_sets(spec.path / "tokenizer.json", spec.max_length)
    key = CacheKey(spec.digest, RECIPE, ov.__version__, nncf.__version__, calibration_digest(sets))
    manifest, source, fp32, probed = build_once(
        spec, key, cache_root, num_threads, lambda fp32, path: _build(fp32, spec, key, path, sets, num_threads),
        check=lambda found, path, load_fp32: _probe(found, path, load_fp32, spec, sets.probe, min_cosine, num_threads))
    # what decides and what /v1/models reports is what this process measured: the judged set of a build it made,
    # the probe of a cached one; a cached refusal is taken as stored, and marked so (its figures are not reported)
    gate = probed if probed is not None else \
        replace(verdict(manifest, min_cosine), measured_on="judge" if source.source == "built" else "stored")
    summary = gate.summary().replace("fp8", "int8", 1) + STORED_NOTE * (gate.measured_on == "stored")
    if gate.passed:
        log.info("%s: %s", spec.name, summary)
        served = Int8CpuEngine(spec, source.path / "model.xml", gate, num_threads)
        served.build_source = source
        return served
    if strict:
        raise Int8Rejected(f"{summary}; the server will not start (serve --dtype float32, lower --int8-min-cosine, "
                           "or pass --no-int8-strict to serve float32 when int8 is refused)")
    log.warning("%s: %s; serving float32 (--no-int8-strict)", spec.name, summary)
    fp32 = None if fallback is not None else fp32  # freed before the settings' float32 engine loads
    engine = fallback_engine(fp32, fallback, spec, num_threads)
    engine.int8_gate = gate
    engine.build_source = source  # the int8 build was made (or found) and judged, though float32 serves
    return engine


def fallback_engine(fp32: TorchEngine | None, fallback: Callable[[], TorchEngine] | None, spec: ModelSpec,
                    num_threads: int) -> TorchEngine:
    """The float32 engine that serves where int8 was refused: `fallback()`'s (the server's settings: packed or
    not, native modules or transformers', its batching), else the one the build loaded, else a default one.
    The build's own float32 engine is transformers' modules (the int8 graph is exported from them), which on
    CPU do not run packed, so it serves only where no `fallback` is given."""
    if fallback is not None:
        gc.collect()  # the build's float32 model and the export's graphs, before a second model loads
        return fallback()
    return fp32 or TorchEngine(spec, dtype="float32", num_threads=num_threads)


def _probe(manifest: dict[str, Any], path: Path, load_fp32: Callable[[], TorchEngine], spec: ModelSpec,
           probe: list[str], min_cosine: float, num_threads: int) -> GateResult | None:
    """A cached build judged again on the probe texts against float32 before it may serve: the verdict this
    process measured. Its stored figures decide nothing here: the folder is writable by the tenant's pod, so
    figures that pass prove nothing. Figures that refuse are taken as they are (None: no probe): a refusal
    serves no int8, so a forged one can only keep int8 from serving, never let a bad build serve."""
    stored = stored_verdict(manifest, lambda m: verdict(m, min_cosine))
    if stored is None:
        return unreadable("embed")
    if not stored.passed:
        return None
    fp32 = load_fp32()
    started = time.perf_counter()
    batches = calibration_batches(spec, Calibration(probe, [], []))
    try:
        candidate = run_calibration(Int8CpuEngine(spec, path / "model.xml", unjudged(), num_threads).embed, batches)
    except Exception as exc:  # a build that does not load or run is a failed build, not a failed start
        return replace(unreadable("embed"), reason=f"it does not run ({type(exc).__name__}: {str(exc)[:200]})")
    gate = probe_verdict(run_calibration(fp32.embed, batches), candidate, min_cosine)
    if gate.passed:
        log.info("%s: the cached int8 build passed its re-judgement on %d probe texts in %.2fs (min cosine %.6f)",
                 spec.name, len(probe), time.perf_counter() - started, gate.min_cosine)
    return gate


def _build(fp32: TorchEngine, spec: ModelSpec, key: CacheKey, path: Path, sets: Int8Sets,
           num_threads: int) -> dict[str, Any]:
    """Quantise on the calibrate texts, measure on the judge texts (none calibrated on), and publish the build
    atomically (a temporary folder renamed into place: a crash never leaves half a build a later start
    would find)."""
    started = time.perf_counter()
    calibrate = calibration_batches(spec, Calibration(sets.calibrate, [], []))
    judge = calibration_batches(spec, Calibration(sets.judge, [], []))
    reference = run_calibration(fp32.embed, judge)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        quantize(fp32, calibrate, tmp)
        candidate = run_calibration(Int8CpuEngine(spec, tmp / "model.xml", unjudged(), num_threads).embed, judge)
        cos = row_cosines(reference, candidate)
        manifest = {"key": asdict(key), "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()),
                    "worst_input": int(np.argmin(cos)), "finite": bool(np.isfinite(candidate).all()),
                    "calibrated_on": len(sets.calibrate), "inputs": len(cos),
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


def unjudged() -> GateResult:
    """The gate result of a build still being measured (the engine needs one to exist)."""
    return GateResult(False, "embed", 0.0, 0.0, 0.0, "not judged yet")
