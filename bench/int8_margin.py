"""What sets INT8_MARGIN_FACTOR (engines/int8_gate.py): the int8 embedder gate's judged minimum against the
minimum over held-out texts neither calibrated on nor judged. One JSON line (and a row appended to
bench/results/int8-margin-cpu.jsonl with run_meta).

Builds all-MiniLM-L6-v2's int8 model as `--dtype int8` does (quantised on `int8_sets`' calibrate half,
judged on its judge half) into a temporary engine cache, then embeds --held-out bench-corpus texts (a seed
nothing in the gate draws from) in float32 and int8. Figures:
  gate.judged_min / judged_mean   the gate's measurement (texts not calibrated on)
  held_out.min / mean            the held-out texts
  deviation_ratio                (1 - held-out min) / (1 - judged min): how much further the served tail
                                 reaches than the judged set; INT8_MARGIN_FACTOR must cover it

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1 .venv/bin/python bench/int8_margin.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import add_results_dir, corpus, record
from embedfleet.runtime.engines.int8_cpu import build_int8_engine
from embedfleet.runtime.engines.int8_gate import INT8_MARGIN_FACTOR
from embedfleet.runtime.engines.quality_gate import row_cosines
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from fp8_gate import HELD_OUT_SEED, embed_all, tokenize


def measure(held_out: int, seed: int, threads: int) -> dict:
    spec = load_spec(default_model_dir())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        # threshold 0 so the build serves whatever it measured; the verdict at 0.99 is computed below
        engine = build_int8_engine(spec, num_threads=threads, cache_root=Path(cache), min_cosine=1e-6)
        built = time.perf_counter() - started
        gate = engine.int8_gate
        items = tokenize(spec, corpus(held_out, seed=seed))
        fp32 = embed_all(TorchEngine(spec, dtype="float32", num_threads=threads).embed, items)
        cos = row_cosines(fp32, embed_all(engine.embed, items))
    judged_dev, held_dev = 1 - gate.min_cosine, 1 - float(cos.min())
    return {"figure": "int8_margin", "model": "all-MiniLM-L6-v2",
            "gate": {"judged_min": round(gate.min_cosine, 5), "judged_mean": round(gate.mean_cosine, 5),
                     "margin_factor": INT8_MARGIN_FACTOR},
            "held_out": {"texts": held_out, "seed": seed, "min": round(float(cos.min()), 5),
                         "mean": round(float(cos.mean()), 5), "below_0_99": int((cos < 0.99).sum())},
            "deviation_ratio": round(held_dev / judged_dev, 3) if judged_dev > 0 else None,
            "build_s": round(built, 1), "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held-out", type=int, default=2000, help="corpus texts neither calibrated on nor judged")
    ap.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="corpus seed of the held-out texts")
    ap.add_argument("--threads", type=int, default=2)
    add_results_dir(ap, "int8-margin-cpu.jsonl")
    args = ap.parse_args()
    row = measure(args.held_out, args.seed, args.threads)
    line = json.dumps(row)
    print(line)
    record("int8-margin", row, results_dir=args.results_dir)



if __name__ == "__main__":
    main()
