"""GPU figures for issue 8, one JSON line each, appended to bench/results/<gpu-name>.jsonl.

1. forward tokens/s, bf16 vs FP8, for a bge-large-sized encoder (24 layers, hidden 1024) and a ~0.6B
   decoder embedder (Qwen3-0.6B shape), random weights, at batch token budgets 8k-64k; model FLOP/s
   and utilisation against the GPU's dense bf16 peak; FP8 / bf16 ratio per budget.
2. single 128-token query latency p50/p99 at concurrency 1 through the real server (encoder, bf16 and fp8).
3. the encoder through sentence-transformers on the same GPU at its best batch size vs our server on
   the same corpus (ratio ours / theirs).
On a machine without CUDA it prints one JSON line saying so and exits 0.

    python3 bench/gpu.py                 # everything (about 10 minutes on an H100)
    python3 bench/gpu.py --only forward  # or: latency, st
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, Server, corpus, percentiles

sys.path.insert(0, str(ROOT))

# dense (no sparsity) bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets
PEAK_BF16 = {"h100 nvl": 835e12, "h100 pcie": 756e12, "h100": 989e12, "h200": 989e12, "gh200": 989e12,
             "b200": 2250e12, "a100": 312e12, "l40s": 362e12, "l4": 121e12}
BUDGETS = (8192, 16384, 32768, 65536)


def peak_flops(gpu: str) -> float | None:
    name = gpu.lower()
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_BF16[key]
    return None


def build_models(root: Path) -> dict[str, Path]:
    """Random-weight models with real tokenizers (the GPU machine has no network)."""
    import torch
    from tests.tiny_models import bert_tokenizer, bpe_tokenizer, sentence_transformers_files
    from transformers import BertConfig, BertModel, Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    out = {}
    d = out["encoder-bge-large"] = root / "encoder-bge-large"
    d.mkdir()
    BertModel(BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                         intermediate_size=4096, max_position_embeddings=512)).to(torch.bfloat16).save_pretrained(d)
    bert_tokenizer(d)
    sentence_transformers_files(d, "cls", 1024)
    d = out["decoder-0.6b"] = root / "decoder-0.6b"
    d.mkdir()
    Qwen2Model(Qwen2Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, intermediate_size=3072, max_position_embeddings=8192,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)).to(torch.bfloat16).save_pretrained(d)
    bpe_tokenizer(d)
    sentence_transformers_files(d, "last", 1024)
    return out


def model_flops_per_token(config, seq: int) -> float:
    """2 x matmul parameters in the layers + attention scores and values (4 x seq x hidden per layer)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = h // heads
    inter = config.intermediate_size
    gated = 3 if config.model_type != "bert" else 2
    per_layer = h * (heads + 2 * kv) * head_dim + heads * head_dim * h + gated * h * inter
    return layers * (2 * per_layer + 4 * seq * h)


def forward_figures(models: dict[str, Path], gpu: str, emit) -> None:
    import torch

    from embedfleet.runtime.engines.fp8 import quantize_model
    from embedfleet.runtime.engines.torch_engine import TorchEngine
    from embedfleet.runtime.models.spec import load_spec

    peak = peak_flops(gpu)
    for name, path in models.items():
        spec = load_spec(path)
        seq = 512
        results: dict[tuple[str, int], float] = {}
        for dtype in ("bfloat16", "fp8"):
            engine = TorchEngine(spec, device="cuda", dtype="bfloat16", max_batch_tokens=max(BUDGETS))
            if dtype == "fp8":  # speed figure: quantise unconditionally (the gate is a separate figure)
                quantize_model(engine.model)
            flops_tok = model_flops_per_token(engine.model.config, seq)
            gen = torch.Generator().manual_seed(0)
            for budget in BUDGETS:
                rows = budget // seq
                batch = torch.randint(1000, 20000, (rows, seq), generator=gen).tolist()
                for _ in range(3):
                    engine.embed(batch)
                torch.cuda.synchronize()
                reps, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < 3.0 or reps < 5:
                    engine.embed(batch)
                    reps += 1
                elapsed = time.perf_counter() - t0
                tps = rows * seq * reps / elapsed
                results[(dtype, budget)] = tps
                line = {"figure": "forward_tokens_per_s", "model": name, "dtype": dtype, "max_batch_tokens": budget,
                        "seq_len": seq, "batch_rows": rows, "tokens_per_s": round(tps),
                        "model_tflops": round(tps * flops_tok / 1e12, 1)}
                if peak:
                    line["bf16_peak_tflops"] = round(peak / 1e12)
                    line["utilisation_of_bf16_peak"] = round(tps * flops_tok / peak, 3)
                if dtype == "fp8":
                    line["fp8_over_bf16"] = round(tps / results[("bfloat16", budget)], 3)
                emit(line)
            del engine
            torch.cuda.empty_cache()


def latency_figures(models: dict[str, Path], emit) -> None:
    import httpx

    path = models["encoder-bge-large"]
    words = " ".join(["token"] * 126)  # + [CLS] [SEP] = 128 tokens with the BERT tokenizer
    for dtype in ("bfloat16", "fp8"):
        srv = Server("--model", str(path), "--device", "cuda", "--dtype", dtype, "--fp8-min-cosine", "0.99")
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                served = c.get("/v1/models").json()["data"][0]["dtype"]
                tokens = len(c.post("/tokenize", json={"inputs": words}).json()[0])
                samples = []
                for i in range(600):
                    t0 = time.perf_counter()
                    r = c.post("/v1/embeddings", json={"input": words})
                    if i >= 100:
                        samples.append(time.perf_counter() - t0)
                    r.raise_for_status()
            emit({"figure": "single_query_latency", "model": "encoder-bge-large", "requested_dtype": dtype,
                  "served_dtype": served, "tokens": tokens, "concurrency": 1, **percentiles(samples)})
        finally:
            srv.stop()


async def _server_throughput(url: str, texts: list[str], per_request: int, concurrency: int) -> float:
    import httpx

    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    queue: asyncio.Queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker() -> None:
            while not queue.empty():
                r = await client.post("/v1/embeddings", json={"input": queue.get_nowait(),
                                                              "encoding_format": "base64"})
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(texts) / (time.perf_counter() - t0)


def sentence_transformers_figure(models: dict[str, Path], emit) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    path = models["encoder-bge-large"]
    texts = corpus(20_000)
    st_model = SentenceTransformer(str(path), device="cuda", model_kwargs={"torch_dtype": torch.bfloat16})
    st_model.encode(texts[:512], batch_size=64)
    best = (0.0, 0)
    for batch_size in (32, 64, 128, 256, 512):
        t0 = time.perf_counter()
        st_model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        rate = len(texts) / (time.perf_counter() - t0)
        best = max(best, (rate, batch_size))
    del st_model
    torch.cuda.empty_cache()
    for dtype in ("bfloat16", "fp8"):
        srv = Server("--model", str(path), "--device", "cuda", "--dtype", dtype, "--fp8-min-cosine", "0.99",
                     "--max-batch-tokens", "32768", "--max-batch-requests", "256")
        try:
            asyncio.run(_server_throughput(srv.url, texts[:2000], 64, 16))
            ours = asyncio.run(_server_throughput(srv.url, texts, 64, 32))
        finally:
            srv.stop()
        emit({"figure": "vs_sentence_transformers", "model": "encoder-bge-large", "inputs": len(texts),
              "dtype": dtype, "ours_embeddings_per_s": round(ours, 1),
              "sentence_transformers_embeddings_per_s": round(best[0], 1),
              "sentence_transformers_best_batch_size": best[1], "ratio": round(ours / best[0], 2)})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("forward", "latency", "st"), help="run one figure group")
    p.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"figure": "gpu", "skipped": True,
                          "reason": "no CUDA device (torch.cuda.is_available() is False); run on an NVIDIA GPU"}))
        return 0
    gpu = torch.cuda.get_device_name()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / (re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-") + ".jsonl")
    meta = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def emit(line: dict) -> None:
        line = {**line, **meta}
        print(json.dumps(line), flush=True)
        with out.open("a") as fh:
            fh.write(json.dumps(line) + "\n")

    with tempfile.TemporaryDirectory(prefix="embedfleet-gpu-bench-") as tmp:
        models = build_models(Path(tmp))
        if args.only in (None, "forward"):
            forward_figures(models, gpu, emit)
        if args.only in (None, "latency"):
            latency_figures(models, emit)
        if args.only in (None, "st"):
            sentence_transformers_figure(models, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
