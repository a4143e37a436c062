"""Every GPU figure in one run, within a time budget; one JSON line each, appended to
bench/results/<gpu-name>.jsonl.

Sections, in order of what a user sees first (each one checks the deadline and is skipped, with a line
saying so, when the rest of the budget would not hold it):

1. `server_vs_st`: the real all-MiniLM-L6-v2 through `embedfleet serve --device cuda` (12,000 natural-order
   texts, 64 per request, 32 concurrent clients in 4 processes, base64) against sentence-transformers
   on the same GPU at its best batch size (bf16 and fp32), and the served vectors' cosine with
   sentence-transformers fp32 on 4,000 of them (the FP8 gate's promise: every input >= --fp8-min-cosine).
   The same for the bge-large shape (random weights) on the natural-order corpus.
2. `single_query_latency`: one 128-token query at concurrency 1 through the server, bge-large shape,
   bf16 and fp8.
3. `profile`: torch.profiler over one server-sized batch (1,024 natural-order texts, MiniLM, packed):
   GPU time by kernel class and host time, so the gap between GPU work and wall time is visible.
4. `forward_tokens_per_s`: engine forward, bge-large shape (24 x 1024) and a 0.6B decoder (Qwen3-0.6B
   shape), seq 512, budgets 16k and 64k: padded transformers vs packed, eager vs torch.compile, bf16 vs
   our FP8 vs torchao's float8 (row-wise) where installed; model FLOP/s and utilisation of the
   GPU's dense bf16 peak (measured: a large bf16 GEMM, and the datasheet figure).
5. `cold_start`: process start -> first answer of `embedfleet serve --device cuda` for the bge-large shape
   and the 0.6B decoder, weights on local disk, with the runtime's own phases (three starts each).

On a machine without CUDA it prints one JSON line saying so and exits 0.

    python3 bench/gpu.py                  # everything, about 5 minutes on an H100
    python3 bench/gpu.py --only latency   # or: server, profile, forward, coldstart
    python3 bench/gpu.py --budget-s 240   # stop starting sections after 240 s
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import (
    ROOT,
    SOURCE_PATHS,
    Server,
    add_results_dir,
    corpus,
    free_port,
    gpu_log_name,
    percentiles,
    record,
    run_meta,
    stop_process,
)

sys.path.insert(0, str(ROOT))

# dense (no sparsity) bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets
PEAK_BF16 = {"h100 nvl": 835e12, "h100 pcie": 756e12, "h100": 989e12, "h200": 989e12, "gh200": 989e12,
             "b200": 2250e12, "a100": 312e12, "l40s": 362e12, "l4": 121e12}
BUDGETS = (16384, 65536)
# --smoke: every section on the CPU at toy sizes, to check this script before spending GPU time on it
SMOKE = {"on": False}
FILTER = {"re": None}  # --filter: run only server runs / forward variants whose label matches


def wanted(label: str) -> bool:
    return FILTER["re"] is None or re.search(FILTER["re"], label) is not None
LOG_DIR = Path(os.environ.get("EMBEDFLEET_BENCH_LOG_DIR", tempfile.gettempdir()))


def peak_flops(gpu: str) -> float | None:
    name = gpu.lower()
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_BF16[key]
    return None


def measured_peak() -> float:
    """bf16 FLOP/s of an 8192^3 GEMM on random data (the ceiling this card reaches through cuBLAS)."""
    import torch

    if SMOKE["on"]:
        return 1e12
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1000)


def build_models(root: Path) -> dict[str, Path]:
    """Random-weight models with real tokenizers (the GPU machine has no network), built on the GPU."""
    import torch
    from tests.tiny_models import bert_tokenizer, bpe_tokenizer, sentence_transformers_files
    from transformers import BertConfig, BertModel, Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    out = {}
    d = out["encoder-bge-large"] = root / "encoder-bge-large"
    d.mkdir()
    small = SMOKE["on"]
    with torch.device(device()):
        BertModel(BertConfig(vocab_size=30522, hidden_size=64 if small else 1024, num_hidden_layers=2 if small else 24,
                             num_attention_heads=4 if small else 16, intermediate_size=128 if small else 4096,
                             max_position_embeddings=512)).to(torch.bfloat16).save_pretrained(d)
    bert_tokenizer(d)
    sentence_transformers_files(d, "cls", 1024)
    d = out["decoder-0.6b"] = root / "decoder-0.6b"
    d.mkdir()
    with torch.device(device()):
        Qwen2Model(Qwen2Config(vocab_size=151936, hidden_size=64 if small else 1024,
                               num_hidden_layers=2 if small else 28, num_attention_heads=4 if small else 16,
                               num_key_value_heads=2 if small else 8, intermediate_size=128 if small else 3072,
                               max_position_embeddings=8192,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)).to(torch.bfloat16).save_pretrained(d)
    bpe_tokenizer(d)
    sentence_transformers_files(d, "last", 1024)
    empty_cache()
    return out


def device() -> str:
    return "cpu" if SMOKE["on"] else "cuda"


def n(full: int, smoke: int) -> int:
    return smoke if SMOKE["on"] else full


def empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


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


def served(*flags: str, name: str) -> Server:
    return Server(*flags, log_file=LOG_DIR / f"server-{name}.log")


# -- 1. server vs sentence-transformers -------------------------------------------------------------
TIME_HEADERS = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")


def _client_process(url: str, chunks: list[list[str]], concurrency: int) -> tuple[int, float, float, dict]:
    import asyncio

    import httpx

    async def run() -> tuple[int, float, float]:
        queue: asyncio.Queue = asyncio.Queue()
        for chunk in chunks:
            queue.put_nowait(chunk)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            async def worker() -> int:
                done = 0
                while not queue.empty():
                    chunk = queue.get_nowait()
                    while True:
                        r = await client.post("/v1/embeddings", json={"input": chunk, "encoding_format": "base64"})
                        if r.status_code != 429:
                            break
                        await asyncio.sleep(float(r.headers.get("retry-after", "1")))  # refused: as told, again
                    if r.status_code != 200:  # a plain error: exceptions with httpx objects do not pickle
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                    for h in TIME_HEADERS:
                        parts[h].append(float(r.headers.get(h, "nan")))
                    done += len(chunk)
                return done

            t0 = time.time()
            counts = await asyncio.gather(*(worker() for _ in range(concurrency)))
            return sum(counts), t0, time.time()

    parts: dict[str, list[float]] = {h: [] for h in TIME_HEADERS}
    done, t0, t1 = asyncio.run(run())
    return done, t0, t1, parts


def server_throughput(url: str, texts: list[str], per_request: int = 64, concurrency: int = 32,
                      processes: int = 4, server_pid: int | None = None, profile_to: Path | None = None) -> float:
    """Embeddings per second through the server: `concurrency` clients split over `processes` client
    processes (one Python client process tops out below what a GPU server answers). With `server_pid`,
    LAST_RUN gets where the server's time went: its own x-*-time medians, and the CPU its event loop (the
    main thread) and its other threads spent per 1,000 embeddings; with `profile_to` and py-spy on the PATH,
    a py-spy profile of the server during the run."""
    import shutil
    import subprocess
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from _common import thread_cpu_seconds

    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    shares = [chunks[p::processes] for p in range(processes)]
    spy = None
    if profile_to is not None and server_pid is not None and shutil.which("py-spy"):
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(server_pid), "--duration", "6", "--rate", "250",
                                "--threads", "--nonblocking", "--format", "raw", "--output", str(profile_to)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = thread_cpu_seconds(server_pid) if server_pid else None
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_client_process, [url] * processes, shares, [concurrency // processes] * processes))
    done = sum(r[0] for r in results)
    rate = done / (max(r[2] for r in results) - min(r[1] for r in results))
    if before is not None:
        after = thread_cpu_seconds(server_pid)
        merged = {h: [v for r in results for v in r[3][h]] for h in TIME_HEADERS}
        LAST_RUN.clear()
        LAST_RUN.update({
            "server_median_ms": {h[2:-5]: float(np.nanmedian(v)) for h, v in merged.items()},
            "loop_cpu_ms_per_1k": round((after[0] - before[0]) * 1e6 / done, 1),
            "other_threads_cpu_ms_per_1k": round((after[1] - before[1]) * 1e6 / done, 1)})
    if spy is not None:
        spy.wait(30)
    return rate


LAST_RUN: dict = {}  # where the server's time went in the last server_throughput run given a server_pid


def pyspy_summary(path: Path, top: int = 8) -> dict:
    """From a py-spy raw profile (--threads): busy samples per thread name, and the event loop's (MainThread)
    most frequent innermost frames: what the loop spends its time on."""
    from collections import Counter

    threads: Counter = Counter()
    leaves: Counter = Counter()
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1]
        threads[re.sub(r"_\d+$", "", name)] += int(count)
        if name == "MainThread" and len(frames) > 1:
            leaves[frames[-1][:90]] += int(count)
    return {"pyspy_busy_samples": dict(threads.most_common(6)), "pyspy_loop_top": leaves.most_common(top)}


def served_vectors(url: str, texts: list[str]) -> np.ndarray:
    import httpx
    import numpy as np

    rows = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(0, len(texts), 256):
            data = c.post("/v1/embeddings", json={"input": texts[i:i + 256], "encoding_format": "base64"}).json()
            rows += [np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32) for d in data["data"]]
    return np.vstack(rows)


def st_rate(path: Path, texts: list[str], dtype: str) -> tuple[float, int, np.ndarray]:
    """sentence-transformers' best embeddings/s over batch sizes 64/256/1024, and its vectors of the first
    4,000 texts."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device=device(),
                                model_kwargs={"torch_dtype": getattr(torch, dtype)})
    model.encode(texts[:n(1024, 16)], batch_size=256)
    best = (0.0, 0)
    for batch_size in (64, 256, 1024) if not SMOKE["on"] else (64,):
        sync()
        t0 = time.perf_counter()
        model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        best = max(best, (len(texts) / (time.perf_counter() - t0), batch_size))
    vectors = model.encode(texts[:4000], batch_size=256, convert_to_numpy=True)
    del model
    empty_cache()
    return best[0], best[1], vectors


def _cosines(a, b):
    import numpy as np

    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def server_figures(models: dict[str, Path], emit, deadline: float) -> None:
    from embedfleet.runtime.settings import default_model_dir

    texts = corpus(n(12_000, 200))
    minilm = default_model_dir()
    st_bf16, st_bs, _ = st_rate(minilm, texts, "bfloat16")
    st_fp32, st_bs32, st_vec = st_rate(minilm, texts, "float32")
    # bfloat16-frontsN: split serving (`--fronts N`: N front processes, one engine; docs/runtime.md);
    # -engines2: two engine processes on the one GPU (`--engines 2`), beside the same fronts with one
    runs = (("bfloat16", ()), ("bfloat16-fronts4", ("--fronts", "4")), ("bfloat16-fronts8", ("--fronts", "8")),
            ("bfloat16-fronts8-engines2", ("--fronts", "8", "--engines", "2")),
            ("fp8", ("--fp8-min-cosine", "0.99")), ("bfloat16-padded", ("--no-packed",)))
    for dtype, extra in runs:
        if not wanted(f"minilm-{dtype}"):
            continue
        if time.monotonic() > deadline:
            emit({"figure": "server_vs_st", "dtype": dtype, "skipped": "time budget"})
            continue
        srv = served("--model", str(minilm), "--device", device(), "--dtype", dtype.split("-")[0], *extra,
                     name=f"minilm-{dtype}")
        try:
            card = srv.card()
            split = "--fronts" in extra  # its time is spread over processes: no one pid to read or profile
            server_throughput(srv.url, texts[:n(3000, 100)])
            ours = server_throughput(srv.url, texts, server_pid=None if split else srv.proc.pid,
                                     profile_to=None if split else LOG_DIR / f"pyspy-minilm-{dtype}.txt",
                                     processes=8 if split else 4)
            if split:
                LAST_RUN.clear()
            where = {**LAST_RUN, **pyspy_summary(LOG_DIR / f"pyspy-minilm-{dtype}.txt")}
            cos = _cosines(st_vec, served_vectors(srv.url, texts[:n(4000, 300)]))
        finally:
            srv.stop()
        emit({"figure": "server_vs_st", "model": "all-MiniLM-L6-v2", "inputs": len(texts), "per_request": 64,
              "concurrency": 32, "requested": dtype, "fronts": int(extra[1]) if split else 0,
              "engines": int(extra[3]) if "--engines" in extra else 1,
              "served_dtype": card.get("dtype"), "packed": card.get("packed"),
              "batching": card.get("batching"), "fp8_gate_min_cosine": card.get("fp8_min_cosine"),
              "ours_embeddings_per_s": round(ours), "st_bf16_embeddings_per_s": round(st_bf16),
              "st_bf16_batch_size": st_bs, "st_fp32_embeddings_per_s": round(st_fp32), "st_fp32_batch_size": st_bs32,
              "ratio_vs_st_bf16": round(ours / st_bf16, 2),
              "cos_vs_st_fp32_min": round(float(cos.min()), 5), "cos_vs_st_fp32_mean": round(float(cos.mean()), 5),
              **where})
    if not wanted("bge-large-server"):
        return
    if time.monotonic() > deadline:
        emit({"figure": "server_vs_st", "model": "encoder-bge-large", "skipped": "time budget"})
        return
    path = models["encoder-bge-large"]
    big = texts[:n(6000, 200)]
    st_big, st_big_bs, _ = st_rate(path, big, "bfloat16")
    srv = served("--model", str(path), "--device", device(), "--dtype", "bfloat16", name="bge-large-bf16")
    try:
        server_throughput(srv.url, big[:n(1500, 50)])
        ours = server_throughput(srv.url, big)
    finally:
        srv.stop()
    emit({"figure": "server_vs_st", "model": "encoder-bge-large", "inputs": len(big), "requested": "bfloat16",
          "ours_embeddings_per_s": round(ours), "st_bf16_embeddings_per_s": round(st_big),
          "st_bf16_batch_size": st_big_bs, "ratio_vs_st_bf16": round(ours / st_big, 2)})


# -- 2. single query latency ------------------------------------------------------------------------
def latency_figures(models: dict[str, Path], emit, deadline: float) -> None:
    import httpx

    path = models["encoder-bge-large"]
    words = " ".join(["token"] * 126)  # + [CLS] [SEP] = 128 tokens with the BERT tokenizer
    for dtype in ("bfloat16", "fp8"):
        if time.monotonic() > deadline:
            emit({"figure": "single_query_latency", "requested_dtype": dtype, "skipped": "time budget"})
            continue
        srv = served("--model", str(path), "--device", device(), "--dtype", dtype, "--fp8-min-cosine", "0.99",
                     name=f"latency-{dtype}")
        try:
            card = srv.card()
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                tokens = len(c.post("/tokenize", json={"inputs": words}).json()[0])
                samples, parts = [], {h: [] for h in ("x-total-time", "x-tokenization-time", "x-queue-time",
                                                      "x-inference-time")}
                for i in range(n(700, 120)):
                    t0 = time.perf_counter()
                    r = c.post("/v1/embeddings", json={"input": words})
                    if i >= 100:
                        samples.append(time.perf_counter() - t0)
                        for h, got in parts.items():
                            got.append(float(r.headers.get(h, "nan")))
                    r.raise_for_status()
        finally:
            srv.stop()
        emit({"figure": "single_query_latency", "model": "encoder-bge-large", "requested_dtype": dtype,
              "served_dtype": card.get("dtype"), "packed": card.get("packed"), "tokens": tokens, "concurrency": 1,
              **percentiles(samples),
              "server_p50_ms": {h[2:-5]: round(float(np.median(v)), 3) for h, v in parts.items()}})
    engine_latency(path, emit)


def coldstart_figures(models: dict[str, Path], emit, deadline: float) -> None:
    """Process start -> ready -> first answer of `embedfleet serve --device cuda` for the bge-large shape and the
    0.6B decoder, weights (safetensors, random) on local disk as a node's cache holds them: the runtime's own
    phases from GET /load (milliseconds: weights, engine load, warm-up, ready) and the first answer as a client
    polling every 50 ms sees it. The runtime has one loader (safetensors, memory-mapped); a streaming loader to
    set beside it does not exist."""
    import httpx

    for name in ("encoder-bge-large", "decoder-0.6b"):
        for attempt in range(n(3, 1)):
            if time.monotonic() > deadline:
                emit({"figure": "cold_start", "model": name, "round": attempt, "skipped": "time budget"})
                continue
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS), HF_HUB_OFFLINE="1")
            started = time.monotonic()
            with open(LOG_DIR / f"server-coldstart-{name}.log", "ab") as sink:
                proc = subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1",
                                         "--port", str(port), "--model", str(models[name]), "--device", device(),
                                         "--dtype", "bfloat16"], env=env, stdout=sink, stderr=sink)
            try:
                answered = None
                with httpx.Client(base_url=url, timeout=30) as client:
                    while answered is None and time.monotonic() - started < 600 and proc.poll() is None:
                        try:
                            if client.post("/v1/embeddings", json={"input": "a first question"}).status_code == 200:
                                answered = time.monotonic() - started
                                break
                        except httpx.TransportError:
                            pass
                        time.sleep(0.05)
                    startup = client.get("/load").json().get("startup", {}) if answered is not None else {}
            finally:
                stop_process(proc)
            emit({"figure": "cold_start", "model": name, "round": attempt, "device": device(),
                  "first_answer_s": None if answered is None else round(answered, 3),
                  "runtime_phases_s": startup.get("phases", {}), "weights_source": startup.get("weights_source")})


def engine_latency(path: Path, emit) -> None:
    """The same 128-token query straight into the engine, with and without its CUDA graphs: the server's
    p50 less this is the host path's share."""
    from embedfleet.runtime.engines.torch_engine import TorchEngine
    from embedfleet.runtime.models.spec import load_spec

    spec = load_spec(path)
    query = [[101] + [5000] * 126 + [102]]
    for graphs in (True, False):
        engine = TorchEngine(spec, device=device(), dtype="bfloat16", cuda_graphs=graphs if not SMOKE["on"] else None)
        engine.warmup()
        samples = []
        for i in range(n(600, 30)):
            t0 = time.perf_counter()
            engine.embed(query)
            if i >= 100 or SMOKE["on"]:
                samples.append(time.perf_counter() - t0)
        emit({"figure": "engine_single_query", "model": "encoder-bge-large", "dtype": "bfloat16",
              "cuda_graphs": bool(engine.graph_shapes), "tokens": len(query[0]), **percentiles(samples)})
        del engine
        empty_cache()
        if SMOKE["on"]:
            break


# -- 3. profile of one server batch ---------------------------------------------------------------
def profile_figure(emit, out_dir: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    from embedfleet.runtime.core.tokenize import TokenizerPool
    from embedfleet.runtime.engines.torch_engine import TorchEngine
    from embedfleet.runtime.models.spec import load_spec
    from embedfleet.runtime.settings import default_model_dir

    spec = load_spec(default_model_dir())
    engine = TorchEngine(spec, device=device(), dtype="bfloat16")
    engine.warmup()
    pool = TokenizerPool(spec.path / "tokenizer.json", 4)
    batch = [t.ids for t in pool._encode_sync(corpus(n(1024, 64), seed=3), spec.max_length, True, "right")]
    for _ in range(3):
        engine.embed(batch)
    sync()
    t0 = time.perf_counter()
    engine.embed(batch)
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.embed(batch)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    (out_dir / "profile-minilm-batch.txt").write_text(table)
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    gemm_us = sum(e.self_device_time_total for e in kernels if re.search(r"gemm|sm90|cutlass|matmul", e.key, re.I))
    attn_us = sum(e.self_device_time_total for e in kernels if re.search(r"flash|attention|fmha", e.key, re.I))
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:5]
    emit({"figure": "profile", "model": "all-MiniLM-L6-v2", "batch_inputs": len(batch),
          "batch_tokens": sum(map(len, batch)), "wall_ms": round(wall * 1000, 2),
          "gpu_kernel_ms": round(gpu_us / 1000, 2),
          "gemm_share": round(gemm_us / gpu_us, 3) if gpu_us else None,
          "attention_share": round(attn_us / gpu_us, 3) if gpu_us else None,
          "top_kernels": [[e.key[:60], round(e.self_device_time_total / 1000, 3)] for e in top]})
    pool.close()
    del engine
    empty_cache()


# -- 4. forward ------------------------------------------------------------------------------------
def _torchao_float8(model, granularity: str = "row") -> str | None:
    """Quantise the transformer layers with torchao's float8 (dynamic activation + weight scales), one scale
    per row (`row`) or per tensor (`tensor`); a reason when torchao is unavailable, else None."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_
    except Exception as exc:
        return f"torchao unavailable: {type(exc).__name__}: {exc}"[:200]
    from embedfleet.runtime.engines.fp8 import transformer_layers

    _, layers = transformer_layers(model)
    quantize_(layers, Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow() if granularity == "row" else PerTensor()))
    return None


def _compile_layers(model) -> None:
    """Regional compilation: each transformer block compiled on its own (identical blocks share one compiled
    graph), so a 28-layer decoder compiles in the time of one block, not of the whole model."""
    from embedfleet.runtime.engines.fp8 import transformer_layers

    _, layers = transformer_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)


def forward_figures(models: dict[str, Path], gpu: str, emit, deadline: float) -> None:
    import torch

    from embedfleet.runtime.engines.fp8 import quantize_model
    from embedfleet.runtime.engines.torch_engine import TorchEngine
    from embedfleet.runtime.models.spec import load_spec

    peak = peak_flops(gpu)
    ceiling = measured_peak()
    emit({"figure": "bf16_gemm_ceiling", "tflops": round(ceiling / 1e12, 1),
          "datasheet_tflops": round(peak / 1e12) if peak else None})
    # (model, label, dtype, packed, compile), in the order of what is least known: the decoder first (never
    # measured before), each model's eager bf16 first (the base of its ratios), compiled FP8 kinds after.
    variants = [
        ("decoder-0.6b", "padded", "bfloat16", False, False),
        ("decoder-0.6b", "padded+compile", "bfloat16", False, True),
        ("decoder-0.6b", "padded+compile", "torchao-fp8", False, True),
        ("decoder-0.6b", "padded+compile", "torchao-fp8-tensor", False, True),
        ("decoder-0.6b", "padded+compile", "fp8", False, True),
        ("decoder-0.6b", "padded", "fp8", False, False),
        ("encoder-bge-large", "packed", "bfloat16", True, False),
        ("encoder-bge-large", "packed+compile", "bfloat16", True, True),
        ("encoder-bge-large", "packed+compile", "torchao-fp8", True, True),
        ("encoder-bge-large", "packed+compile", "torchao-fp8-tensor", True, True),
        ("encoder-bge-large", "packed+compile", "fp8", True, True),
        ("encoder-bge-large", "padded", "bfloat16", False, False),
        ("encoder-bge-large", "packed", "fp8", True, False),
    ]
    base: dict[tuple[str, int], float] = {}  # eager bf16, per (model, budget)
    best_bf16: dict[tuple[str, int], float] = {}  # the fastest bf16 so far: FP8's ratio is against it
    seq = 512
    for name, label, dtype, packed, compiled in variants:
        if not wanted(f"{name}/{label}/{dtype}"):
            continue
        if time.monotonic() > deadline:
            emit({"figure": "forward_tokens_per_s", "model": name, "variant": label, "dtype": dtype,
                  "skipped": "time budget"})
            continue
        spec = load_spec(models[name])
        try:
            if compiled and SMOKE["on"]:
                continue
            engine = TorchEngine(spec, device=device(), dtype="bfloat16", packed=packed, cuda_graphs=False)
            note = None
            if dtype == "fp8":  # speed figure: quantise unconditionally (the gate is a separate figure)
                quantize_model(engine.model)
            elif dtype.startswith("torchao-fp8"):
                note = _torchao_float8(engine.model, "tensor" if dtype.endswith("tensor") else "row")
                if note:
                    emit({"figure": "forward_tokens_per_s", "model": name, "variant": label, "dtype": dtype,
                          "skipped": note})
                    continue
            if compiled and not packed:
                _compile_layers(engine.model)
            elif compiled:
                engine.packed._layer_fn = torch.compile(engine.packed._layer, dynamic=True)
            flops_tok = model_flops_per_token(engine.model.config, seq)
            gen = torch.Generator().manual_seed(0)
            started = time.perf_counter()
            for budget in (BUDGETS if not SMOKE["on"] else (1024,)):
                rows = budget // seq
                batch = torch.randint(1000, 20000, (rows, seq), generator=gen).tolist()
                engine.embed(batch)
                engine.embed(batch)
                sync()
                reps, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < n(1, 0) or reps < 3:
                    engine.embed(batch)
                    reps += 1
                tps = rows * seq * reps / (time.perf_counter() - t0)
                if dtype == "bfloat16" and label in ("padded", "packed"):
                    base.setdefault((name, budget), tps)
                if dtype == "bfloat16":
                    best_bf16[(name, budget)] = max(best_bf16.get((name, budget), 0.0), tps)
                line = {"figure": "forward_tokens_per_s", "model": name, "variant": label, "dtype": dtype,
                        "max_batch_tokens": budget, "seq_len": seq, "batch_rows": rows, "tokens_per_s": round(tps),
                        "model_tflops": round(tps * flops_tok / 1e12, 1),
                        "utilisation_of_measured_gemm": round(tps * flops_tok / ceiling, 3)}
                if peak:
                    line["utilisation_of_bf16_peak"] = round(tps * flops_tok / peak, 3)
                if (name, budget) in base:
                    line["over_eager_bf16"] = round(tps / base[(name, budget)], 3)
                if dtype != "bfloat16" and (name, budget) in best_bf16:
                    line["over_best_bf16"] = round(tps / best_bf16[(name, budget)], 3)
                emit(line)
            emit({"figure": "forward_setup_s", "model": name, "variant": label, "dtype": dtype,
                  "seconds_incl_compile": round(time.perf_counter() - started, 1)})
        except Exception as exc:
            emit({"figure": "forward_tokens_per_s", "model": name, "variant": label, "dtype": dtype,
                  "error": f"{type(exc).__name__}: {exc}"[:500]})
        finally:
            engine = None
            torch._dynamo.reset()
            empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated sections to run: server, latency, profile, forward, coldstart")
    p.add_argument("--filter", help="regex: only the server runs (minilm-bfloat16, minilm-fp8, minilm-bfloat16-padded, "
                   "bge-large-server) and forward variants (model/variant/dtype) it matches")
    p.add_argument("--budget-s", type=float, default=300.0, help="start no section after this many seconds")
    add_results_dir(p, "<gpu-name>.jsonl")

    p.add_argument("--smoke", action="store_true", help="on the CPU at toy sizes: checks this script, no figures")
    args = p.parse_args()
    import torch

    SMOKE["on"] = args.smoke
    FILTER["re"] = args.filter
    if args.smoke:
        args.results_dir = Path(tempfile.mkdtemp(prefix="gpu-bench-smoke-"))
    elif not torch.cuda.is_available():
        print(json.dumps({"figure": "gpu", "skipped": True,
                          "reason": "no CUDA device (torch.cuda.is_available() is False); run on an NVIDIA GPU"}))
        return 0
    began = time.monotonic()
    deadline = began + (args.budget_s if not args.smoke else 1e9)
    gpu = torch.cuda.get_device_name() if not args.smoke else "cpu-smoke"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    log = gpu_log_name(gpu)  # bench/results/<log>.jsonl
    run = run_meta()  # one for the whole run: its rows share the date
    meta = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, **run}

    def emit(line: dict) -> None:
        line = {**line, **meta, "t_s": round(time.monotonic() - began, 1)}
        print(json.dumps(line), flush=True)
        record(log, line, device="", results_dir=args.results_dir, meta=run)

    sections = {"server": lambda m: server_figures(m, emit, deadline),
                "latency": lambda m: latency_figures(m, emit, deadline),
                "profile": lambda m: profile_figure(emit, LOG_DIR),
                "forward": lambda m: forward_figures(m, gpu, emit, deadline),
                "coldstart": lambda m: coldstart_figures(m, emit, deadline)}
    with tempfile.TemporaryDirectory(prefix="embedfleet-gpu-bench-") as tmp:
        models = build_models(Path(tmp))
        emit({"figure": "models_built", "seconds": round(time.monotonic() - began, 1)})
        for name, section in sections.items():  # not `run`: emit() reads the run's meta by that name
            if args.only and name not in args.only.split(","):
                continue
            try:
                section(models)
            except Exception as exc:
                import traceback

                traceback.print_exc()
                emit({"figure": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
    emit({"figure": "gpu_bench_total", "seconds": round(time.monotonic() - began, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
