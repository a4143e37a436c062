"""Int8 on CPU for the embedded default, backend by backend: what each costs to build and start, how fast
it runs a backfill-like batch, and how far its vectors move from float32.

Every backend serves all-MiniLM-L6-v2 (mean pooling) on the same threads. Speed: the same length-sorted
batches of the natural-order corpus, rounds alternating between float32 PyTorch (the served engine) and the
backend, best round of each (a round hit by another process' burst says nothing about the engine), so each
ratio comes from one run. Quality: cosine of every held-out vector (a corpus seed the calibration set never
saw) with its float32 twin, min and mean. Backends that are not installed are skipped with a reason.
Prints one JSON line, also appended to bench/results/int8_backends-cpu.jsonl.

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1 .venv/bin/python bench/int8_backends.py
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from _common import add_results_dir, corpus, record
from embedfleet.runtime.engines.base import pad_batch
from embedfleet.runtime.engines.quality_gate import load_calibration, row_cosines
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import ModelSpec, load_spec
from embedfleet.runtime.settings import default_model_dir

Embed = Callable[[list], np.ndarray]
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def installed_mb(*dists: str) -> float:
    """Installed size of the distributions a backend adds (what an image grows by), in MB."""
    total = 0
    for name in dists:
        try:
            files = importlib.metadata.files(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        total += sum(f.locate().stat().st_size for f in files if f.locate().is_file())
    return round(total / 1e6, 1)


def tokenized(spec: ModelSpec, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.path / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=spec.max_length)
    return [list(e.ids) for e in tok.encode_batch(texts)]


def length_batches(ids: list[list[int]], size: int) -> list[list[list[int]]]:
    order = sorted(ids, key=len)
    return [order[i:i + size] for i in range(0, len(order), size)]


def feeds(batch: list) -> dict[str, np.ndarray]:
    p = pad_batch(batch, 0)
    return {"input_ids": p.ids, "attention_mask": p.mask, "token_type_ids": np.zeros_like(p.ids)}


class Pooled(torch.nn.Module):
    """The encoder with mean pooling in the graph, so every backend returns the served vector."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            token_type_ids=token_type_ids).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


def export_onnx(model: torch.nn.Module, sample: list, path: Path) -> None:
    args = tuple(torch.from_numpy(v) for v in feeds(sample).values())
    axes = {k: {0: "batch", 1: "tokens"} for k in INPUTS} | {"embedding": {0: "batch"}}
    torch.onnx.export(Pooled(model).eval(), args, str(path), input_names=list(INPUTS), output_names=["embedding"],
                      dynamic_axes=axes, opset_version=17, dynamo=False)


# -- backends: each returns (embed function, seconds to quantise, seconds to start from the artifact) ------
def torch_dynamic(engine: TorchEngine, work: Path, calib: list, threads: int) -> tuple[Embed, float, float]:
    """torch.ao dynamic int8: per-channel weights, per-tensor 7-bit activations (fbgemm), FFN-down in fp32."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    started = time.perf_counter()
    model = copy.deepcopy(engine.model)
    keep = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layer." in n
            and not (n.endswith("output.dense") and "attention" not in n)}
    model = quantize_dynamic(model, dict.fromkeys(keep, per_channel_dynamic_qconfig), dtype=torch.qint8)
    built = time.perf_counter() - started
    twin = copy.copy(engine)
    twin.model = twin._forward = model
    return twin.embed, built, 0.0


def ort_session(path: Path, threads: int) -> Embed:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return lambda batch: session.run(None, feeds(batch))[0]


def ort_fp32(engine: TorchEngine, work: Path, calib: list, threads: int) -> tuple[Embed, float, float]:
    started = time.perf_counter()
    export_onnx(engine.model, calib[0], work / "fp32.onnx")
    built = time.perf_counter() - started
    started = time.perf_counter()
    fn = ort_session(work / "fp32.onnx", threads)
    return fn, built, time.perf_counter() - started


def ort_dynamic(engine: TorchEngine, work: Path, calib: list, threads: int,
                exclude_ffn_down: bool = False) -> tuple[Embed, float, float]:
    """ONNX Runtime dynamic int8: per-channel int8 weights, per-tensor uint8 activations computed per call."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    started = time.perf_counter()
    if not (work / "fp32.onnx").exists():
        export_onnx(engine.model, calib[0], work / "fp32.onnx")
    exclude = [n.name for n in onnx.load(str(work / "fp32.onnx")).graph.node
               if exclude_ffn_down and n.op_type == "MatMul" and "/output/dense/" in n.name
               and "/attention/" not in n.name]
    out = work / f"dyn{len(exclude)}.onnx"
    quantize_dynamic(str(work / "fp32.onnx"), str(out), per_channel=True, weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul"], nodes_to_exclude=exclude)
    built = time.perf_counter() - started
    started = time.perf_counter()
    fn = ort_session(out, threads)
    return fn, built, time.perf_counter() - started


def ort_static(engine: TorchEngine, work: Path, calib: list, threads: int) -> tuple[Embed, float, float]:
    """ONNX Runtime static int8 (QDQ): activation ranges calibrated once on calibration.json, per-channel weights."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter([feeds(b) for b in calib])

        def get_next(self):
            return next(self.items, None)

    started = time.perf_counter()
    if not (work / "fp32.onnx").exists():
        export_onnx(engine.model, calib[0], work / "fp32.onnx")
    quantize_static(str(work / "fp32.onnx"), str(work / "static.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, weight_type=QuantType.QInt8, activation_type=QuantType.QUInt8,
                    op_types_to_quantize=["MatMul"])
    built = time.perf_counter() - started
    started = time.perf_counter()
    fn = ort_session(work / "static.onnx", threads)
    return fn, built, time.perf_counter() - started


def openvino_nncf(engine: TorchEngine, work: Path, calib: list, threads: int,
                  recipe: bool = True) -> tuple[Embed, float, float]:
    """OpenVINO + NNCF int8 as `--dtype int8` builds it (engines/int8_cpu.py: transformer preset, SmoothQuant,
    FFN-down kept float32, calibrated on calibration.json plus stress texts); recipe=False quantises every
    MatMul NNCF would, calibrated on calibration.json alone."""
    from embedfleet.runtime.engines.int8_cpu import Int8CpuEngine, int8_calibration, quantize, unjudged
    from embedfleet.runtime.engines.quality_gate import calibration_batches

    spec = engine.spec
    batches = calibration_batches(spec, int8_calibration()) if recipe else calib
    started = time.perf_counter()
    quantize(engine, batches, work, keep_float=recipe)
    built = time.perf_counter() - started
    started = time.perf_counter()
    served = Int8CpuEngine(spec, work / "model.xml", unjudged(), threads)
    return served.embed, built, time.perf_counter() - started


BACKENDS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "torch_dynamic_int8": (torch_dynamic, ()),
    "ort_fp32": (ort_fp32, ("onnxruntime",)),
    "ort_dynamic_int8": (ort_dynamic, ("onnxruntime",)),
    "ort_dynamic_int8_ffn_down_fp32": (lambda *a: ort_dynamic(*a, exclude_ffn_down=True), ("onnxruntime",)),
    "ort_static_int8": (ort_static, ("onnxruntime",)),
    "openvino_nncf_int8_every_matmul": (lambda *a: openvino_nncf(*a, recipe=False), ("openvino", "nncf")),
    "openvino_nncf_int8_runtime_recipe": (openvino_nncf, ("openvino", "nncf")),
}


def run_all(fn: Embed, batches: list) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    out = np.concatenate([np.asarray(fn(b), dtype=np.float32) for b in batches])
    return out, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held-out", type=int, default=2000, help="texts for the quality figures")
    p.add_argument("--texts", type=int, default=384, help="texts of the throughput batches")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", nargs="*", default=None, help="backends to run (default: all installed)")
    add_results_dir(p, "int8_backends-cpu.jsonl")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    spec = load_spec(default_model_dir())
    engine = TorchEngine(spec, dtype="float32", num_threads=a.threads)
    calib = length_batches(tokenized(spec, load_calibration().texts), 16)
    speed = length_batches(tokenized(spec, corpus(a.texts, seed=0)), a.batch)
    held = length_batches(tokenized(spec, corpus(a.held_out, seed=11)), a.batch)
    reference, _ = run_all(engine.embed, held)
    rows = {}
    for name, (build, dists) in BACKENDS.items():
        if a.only is not None and name not in a.only:
            continue
        missing = [d for d in dists if installed_mb(d) == 0]
        if missing:
            rows[name] = {"skipped": f"not installed: {', '.join(missing)}"}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            fn, built, start = build(engine, Path(tmp), calib, a.threads)
            cos = row_cosines(reference, run_all(fn, held)[0])
            fp32_s, int8_s = [], []
            run_all(fn, speed[:2])
            for _ in range(a.rounds):
                fp32_s.append(run_all(engine.embed, speed)[1])
                int8_s.append(run_all(fn, speed)[1])
        rows[name] = {"speed_over_fp32_torch": round(min(fp32_s) / min(int8_s), 2),
                      "cos_min": round(float(cos.min()), 5), "cos_mean": round(float(cos.mean()), 5),
                      "inputs_below_0.99": int((cos < 0.99).sum()),
                      "quantize_s": round(built, 2), "start_s": round(start, 3),
                      "installed_mb": installed_mb(*dists), "fp32_texts_per_s": round(a.texts / min(fp32_s), 1)}
        print(json.dumps({name: rows[name]}), file=sys.stderr, flush=True)
    row = {"figure": "int8_backends", "model": spec.name, "threads": a.threads, "held_out": a.held_out,
           "throughput_texts": a.texts, "batch": a.batch, "rounds": a.rounds, "backends": rows}
    print(json.dumps(row))
    record("int8_backends", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
