"""Our CPU server against Infinity on the same machine, corpus and load generator, in one run: float32
against Infinity's torch engine, and `--dtype int8` against Infinity's own int8 path (ONNX Runtime through
optimum: the model exported to ONNX and dynamically quantised for AVX-512 VNNI, the file Infinity prefers
on CPU). One JSON line.

Figures (goals in brackets):
  c16_rps_fp32_over_infinity       16 concurrent single queries, requests/s, ours / Infinity torch   [>= 2]
  c16_p99_fp32_over_infinity       their p99 latency, ours / Infinity's                             [<= 0.5]
  backfill_fp32_over_infinity      natural-order backfill, 64 inputs per request, 8 in flight
  backfill_int8_over_infinity_int8 the same with both int8 paths
  quality.<server>                 cosine of each held-out text's vector with our float32 server's

Infinity runs from its own virtual environment, with the versions its 0.0.78 release works with (its
ONNX path imports optimum 1.x's exporter, which does not import under a newer torch):

    python -m venv /tmp/infvenv
    /tmp/infvenv/bin/pip install "infinity-emb[server,optimum]==0.0.78" "torch==2.5.1" \
        "transformers==4.48.3" "optimum[onnxruntime]==1.24.0" "numpy<2" "pyarrow==19.0.1" \
        "sentence-transformers>=3.0.1,<4"
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1 .venv/bin/python bench/cpu_peers.py \
        --infinity /tmp/infvenv/bin/infinity_emb --infinity-python /tmp/infvenv/bin/python

Servers run one at a time; each is warmed up by its first requests. The int8 ONNX file is made with
optimum's own exporter and ORTQuantizer (dynamic, per-channel, AVX-512 VNNI) in Infinity's environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from _common import Server, add_results_dir, corpus, free_port, record, wait_ready
from embedfleet.runtime.engines.int8_cpu import build_int8_engine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from serve_load import backfill, online

MODEL = "all-MiniLM-L6-v2"
HELD_OUT_SEED = 7

EXPORT = """
import sys
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig
src, out = sys.argv[1], sys.argv[2]
ORTModelForFeatureExtraction.from_pretrained(src, export=True).save_pretrained(out)
quantizer = ORTQuantizer.from_pretrained(out, file_name="model.onnx")
quantizer.quantize(save_dir=out, quantization_config=AutoQuantizationConfig.avx512_vnni(is_static=False,
                                                                                         per_channel=True))
"""


def infinity_model_dir(python: str, work: Path) -> tuple[Path, float]:
    """A copy of the embedded model with Infinity's int8 ONNX file (``model_quantized.onnx``) beside it."""
    out = work / "minilm-onnx"
    shutil.copytree(default_model_dir(), out)
    started = time.perf_counter()
    subprocess.run([python, "-c", EXPORT, str(out), str(out)], check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out, time.perf_counter() - started


class Infinity:
    def __init__(self, binary: str, model_dir: Path, engine: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "v2", "--model-id", str(model_dir), "--served-model-name", MODEL, "--port", str(self.port),
             "--engine", engine, "--device", "cpu", "--batch-size", "32", "--no-bettertransformer",
             # the model's own pooling (its 1_Pooling config): Infinity's ONNX path guesses CLS otherwise
             "--pooling-method", "mean"],
            env=dict(os.environ, HF_HUB_OFFLINE="1", INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_ready(self.url, self.proc, path="/health")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def vectors(url: str, path: str, texts: list[str]) -> np.ndarray:
    rows: list[list[float]] = []
    async with aiohttp.ClientSession(url) as client:
        for start in range(0, len(texts), 32):
            body = orjson.dumps({"model": MODEL, "input": texts[start:start + 32]})
            async with client.post(path, data=body, headers={"content-type": "application/json"}) as resp:
                resp.raise_for_status()
                rows.extend(d["embedding"] for d in orjson.loads(await resp.read())["data"])
    a = np.array(rows, dtype=np.float32)
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def figures(url: str, path: str, texts: list[str], held_out: list[str]) -> dict[str, Any]:
    return {"backfill": asyncio.run(backfill(url, MODEL, texts, 64, 8, path)),
            "c1": asyncio.run(online(url, MODEL, 1, 300, path)),
            "c16": asyncio.run(online(url, MODEL, 16, 800, path)),
            "vectors": asyncio.run(vectors(url, path, held_out))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--infinity", required=True, help="Infinity's infinity_emb executable")
    p.add_argument("--infinity-python", required=True, help="the python of Infinity's venv (ONNX export)")
    p.add_argument("--n", type=int, default=3_000, help="backfill texts")
    p.add_argument("--held-out", type=int, default=500)
    add_results_dir(p, "cpu-peers-cpu.jsonl")
    a = p.parse_args()
    texts, held_out = corpus(a.n), corpus(a.held_out, seed=HELD_OUT_SEED)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="embedfleet-peers-") as tmp:
        work = Path(tmp)
        onnx_dir, export_s = infinity_model_dir(a.infinity_python, work)
        build_int8_engine(load_spec(default_model_dir()), num_threads=2, cache_root=work / "engines")
        starts = {
            "ours_fp32": lambda: Server("--dtype", "float32"),
            "ours_int8": lambda: Server("--dtype", "int8", "--engine-cache-dir", str(work / "engines")),
            "infinity_torch": lambda: Infinity(a.infinity, default_model_dir(), "torch"),
            "infinity_onnx_int8": lambda: Infinity(a.infinity, onnx_dir, "optimum"),
        }
        for name, start in starts.items():
            server = start()
            try:
                path = "/v1/embeddings" if name.startswith("ours") else "/embeddings"
                results[name] = figures(server.url, path, texts, held_out)
            finally:
                server.stop()
    ref = results["ours_fp32"].pop("vectors")
    quality = {}
    for name, got in results.items():
        if name == "ours_fp32":
            continue
        cos = np.sum(ref * got.pop("vectors"), axis=1)
        quality[name] = {"cos_min": round(float(cos.min()), 4), "cos_mean": round(float(cos.mean()), 5),
                         "below_0_99": int((cos < 0.99).sum())}
    ours, inf = results["ours_fp32"], results["infinity_torch"]
    int8, inf8 = results["ours_int8"], results["infinity_onnx_int8"]
    out = {"figure": "cpu_peers", "model": MODEL, "machine": platform.processor() or platform.machine(),
           "cores": len(os.sched_getaffinity(0)), "infinity_onnx_export_s": round(export_s, 1),
           "c16_rps_fp32_over_infinity": round(ours["c16"]["requests_per_s"] / inf["c16"]["requests_per_s"], 2),
           "c16_p99_fp32_over_infinity": round(ours["c16"]["p99_ms"] / inf["c16"]["p99_ms"], 2),
           "c1_p50_fp32_over_infinity": round(ours["c1"]["p50_ms"] / inf["c1"]["p50_ms"], 2),
           "backfill_fp32_over_infinity": round(ours["backfill"]["embeddings_per_s"]
                                                / inf["backfill"]["embeddings_per_s"], 2),
           "backfill_int8_over_infinity_int8": round(int8["backfill"]["embeddings_per_s"]
                                                     / inf8["backfill"]["embeddings_per_s"], 2),
           "c16_rps_int8_over_infinity_int8": round(int8["c16"]["requests_per_s"] / inf8["c16"]["requests_per_s"], 2),
           "quality": quality, "servers": results}
    line = json.dumps(out)
    print(line)
    record("cpu-peers", out, results_dir=a.results_dir)



if __name__ == "__main__":
    main()
