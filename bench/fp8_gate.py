"""Does the FP8 quality gate keep its promise on texts it never saw? One JSON line per run, also appended to
bench/results/fp8-gate-<device>.jsonl (fp8-gate-cpu.jsonl; with `--device cuda` the GPU's name as bench/gpu.py
spells it, fp8-gate-NVIDIA-H200.jsonl).

The gate (engines/quality_gate.py) judges FP8 on its calibration inputs at start-up; users send other
texts. This runs the gate as `--dtype fp8 --fp8-min-cosine THRESHOLD` does (`--fixed-only --margin-factor
1` runs it as it was before the vocabulary passages and the margin), then embeds --held-out texts of
the bench corpus (a seed the calibration never used: short queries, 20-60 and 80-220 word passages of
rare vocabulary words) with FP8 (quantised whatever the verdict, to see what it would have served), with
bf16, and with float32, and reports:

  gate.passed / calibration_min / required / margin_factor   the verdict, the calibration minimum it
                                judged on, and the bound that minimum had to reach
  held_out.fp8_vs_bf16          min / mean cosine of FP8 against bf16 (what the gate's threshold is about)
  held_out.fp8_vs_fp32          min / mean cosine of FP8 against float32
  held_out.served_vs_bf16       what the server sends (FP8 if accepted, else bf16) against bf16, and how
                                many held-out inputs fall below the threshold (the promise: none)

FP8 runs the fp32 emulation on CPU (engines/fp8.py): the numbers the Hopper kernel computes, slowly;
`--device cuda` runs the kernel.

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1 .venv/bin/python bench/fp8_gate.py --threshold 0.99
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from tokenizers import Tokenizer

from _common import add_results_dir, corpus, device_name, record
from embedfleet.runtime.engines.fp8 import quantize_model
from embedfleet.runtime.engines.quality_gate import (
    FP8_MARGIN_FACTOR,
    fp8_calibration,
    gate_fp8,
    load_calibration,
    row_cosines,
)
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import ModelSpec, load_spec
from embedfleet.runtime.settings import default_model_dir

MODEL = "all-MiniLM-L6-v2"  # the embedded default model (settings.default_model_dir())
HELD_OUT_SEED = 7  # bench/_common.py corpus(); the gate's calibration draws nothing from it


def tokenize(spec: ModelSpec, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(str(spec.path / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=spec.max_length)
    return [list(e.ids) for e in tok.encode_batch(texts)]


def embed_all(fn, items: list[list[int]], batch_tokens: int = 8192) -> np.ndarray:
    """Length-sorted batches (little padding, as the server packs them), rows back in input order."""
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    out: list[np.ndarray | None] = [None] * len(items)
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop - start + 1) * len(items[order[stop]]) <= batch_tokens and stop - start < 64:
            stop += 1
        rows = fn([items[i] for i in order[start:stop]])
        for j, i in enumerate(order[start:stop]):
            out[i] = rows[j]
        start = stop
    return np.stack(out).astype(np.float32)


def stats(cos: np.ndarray) -> dict:
    return {"min": round(float(cos.min()), 5), "mean": round(float(cos.mean()), 5)}


def measure(threshold: float, held_out: int, seed: int, threads: int, device: str = "cpu",
            margin_factor: float = FP8_MARGIN_FACTOR, fixed_only: bool = False) -> dict:
    spec = load_spec(default_model_dir())
    items = tokenize(spec, corpus(held_out, seed=seed))
    started = time.perf_counter()
    fp32 = embed_all(TorchEngine(spec, device=device, dtype="float32", num_threads=threads).embed, items)
    engine = TorchEngine(spec, device=device, dtype="bfloat16", num_threads=threads)
    bf16 = embed_all(engine.embed, items)
    # what TorchEngine(dtype="fp8") runs, with the calibration and margin as arguments
    calibration = load_calibration() if fixed_only else fp8_calibration(spec)
    gate = gate_fp8(engine, spec, threshold, calibration=calibration, margin_factor=margin_factor)
    if not gate.passed:  # what FP8 would have served: the refused model, quantised anyway
        quantize_model(engine.model)
    fp8 = embed_all(engine.embed, items)
    served = fp8 if gate.passed else bf16
    fp8_bf16, served_bf16 = row_cosines(bf16, fp8), row_cosines(bf16, served)
    lengths = np.array([len(x) for x in items])
    return {
        "figure": "fp8_gate", "model": MODEL, "device": device, "machine": platform.machine(),
        "threshold": threshold,
        "gate": {"passed": gate.passed, "calibration_min": round(gate.min_cosine, 5),
                 "calibration_mean": round(gate.mean_cosine, 5), "required": round(gate.required or threshold, 5),
                 "margin_factor": margin_factor, "calibration_inputs": len(calibration.texts),
                 "calibration": "fixed" if fixed_only else "fixed+vocabulary"},
        "held_out": {"texts": held_out, "seed": seed, "fp8_vs_bf16": stats(fp8_bf16),
                     "fp8_vs_fp32": stats(row_cosines(fp32, fp8)), "bf16_vs_fp32": stats(row_cosines(fp32, bf16)),
                     "fp8_below_threshold": int((fp8_bf16 < threshold).sum()),
                     "worst_tokens": int(lengths[int(np.argmin(fp8_bf16))]),
                     "served": "fp8" if gate.passed else "bfloat16", "served_vs_bf16": stats(served_bf16),
                     "served_vs_fp32": stats(row_cosines(fp32, served)),
                     "served_below_threshold": int((served_bf16 < threshold).sum())},
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threshold", type=float, default=0.99, help="--fp8-min-cosine")
    ap.add_argument("--held-out", type=int, default=2000, help="corpus texts the gate never saw")
    ap.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="corpus seed of the held-out texts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--margin-factor", type=float, default=FP8_MARGIN_FACTOR,
                    help="how far the served tail is taken to reach beyond the calibration minimum (1: no margin)")
    ap.add_argument("--fixed-only", action="store_true", help="judge on calibration.json alone")
    add_results_dir(ap, "fp8-gate-<device>.jsonl (cpu, or the GPU's name)")
    args = ap.parse_args()
    row = measure(args.threshold, args.held_out, args.seed, args.threads, args.device, args.margin_factor,
                  args.fixed_only)
    print(json.dumps(row))
    record("fp8-gate", row, device=device_name(args.device), results_dir=args.results_dir)


if __name__ == "__main__":
    main()
