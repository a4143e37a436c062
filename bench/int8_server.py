"""int8 against float32 on CPU, as served: `embedfleet serve --dtype int8` and `--dtype float32` under the
same load in one run, the float32 in-process ceiling, and the int8 vectors' quality against float32 on
texts the gate never saw. One JSON line.

Figures (goals in brackets):
  backfill_int8_over_fp32      server backfill, embeddings/s, int8 / float32 (natural-order corpus, 64 inputs
                               per request, 8 in flight; median of --rounds alternating rounds)   [>= 1.8]
  backfill_int8_over_ceiling   the int8 server / the float32 in-process ceiling (bench/ceiling.py)  [>= 1.8]
  c1_p50_int8_over_fp32        one short query at a time, p50 latency, int8 / float32             [<= 0.7]
  quality.cos_min / cos_mean   each of --held-out texts (a corpus seed calibration never used) embedded by
                               both engines in-process                                            [min >= 0.99]
  quality.random_vocabulary.top10_overlap   --queries keyword queries (4-8 consecutive words of a passage)
                               over a --passages index of the random-vocabulary corpus: mean share of
                               float32's top 10 that int8's top 10 also holds                     [>= 0.98]
  quality.prose.top10_overlap  the same over real prose: docstring summary lines against docstring
                               paragraphs of the standard library and installed packages (prose.py)  [>= 0.98]
  quality.source_at_1          how often each engine ranks the query's own passage first
  quality.noise_same_cos_top10_overlap   the overlap float32 keeps against itself plus isotropic noise of
                               the size that gives int8's mean cosine on the index: what any perturbation
                               that large costs on this corpus (its ranks 2-10 are near-ties: see
                               rank9_rank10_gap_median)

The int8 build is made once into a temporary engine cache before the servers start (the first start of a
digest quantises; later starts load it), so no timing includes it; its build time is reported apart.

    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 HF_HUB_OFFLINE=1 .venv/bin/python bench/int8_server.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import Server, add_results_dir, corpus, record
from ceiling import measure as ceiling
from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.engines.int8_cpu import build_int8_engine
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from prose import retrieval_set
from serve_load import backfill, online

MODEL = "all-MiniLM-L6-v2"
HELD_OUT_SEED, PASSAGE_SEED, QUERY_SEED = 7, 11, 12


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _encode(engine: object, pool: TokenizerPool, texts: list[str], max_length: int, batch: int = 32) -> np.ndarray:
    ids = [t.ids for t in pool._encode_sync(texts, max_length, True, "right")]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # length-sorted batches, as the server packs
    out = np.zeros((len(ids), 0), dtype=np.float32)
    rows: dict[int, np.ndarray] = {}
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        for i, vec in zip(chunk, engine.embed([ids[i] for i in chunk]), strict=True):  # type: ignore[attr-defined]
            rows[i] = vec
    out = np.stack([rows[i] for i in range(len(ids))])
    return _unit(out.astype(np.float32))


def keyword_queries(passages: list[str], n: int) -> tuple[list[str], list[int]]:
    """Queries that have an answer in the index: 4-8 consecutive words of a random passage (the corpus is
    random vocabulary, so a query made up apart from the passages would have no relevant passage, and its
    top 10 would be near-ties that say nothing about the vectors)."""
    rng = random.Random(QUERY_SEED)
    out, sources = [], []
    for _ in range(n):
        source = rng.randrange(len(passages))
        words = passages[source].split()
        size = min(len(words), rng.randint(4, 8))
        start = rng.randint(0, len(words) - size)
        out.append(" ".join(words[start:start + size]))
        sources.append(source)
    return out, sources


def retrieval(engines: dict[str, object], pool: TokenizerPool, max_length: int, index_texts: list[str],
              query_texts: list[str], sources: list[int]) -> dict:
    """Top-10 overlap of int8's ranking with float32's over one index, how often each ranks the query's own
    passage first, and what isotropic noise of int8's size costs on the same index."""
    fp32, int8 = engines["float32"], engines["int8"]
    index_a, index_b = (_encode(e, pool, index_texts, max_length) for e in (fp32, int8))
    q_a, q_b = (_encode(e, pool, query_texts, max_length) for e in (fp32, int8))
    top_a = np.argsort(-(q_a @ index_a.T), axis=1)[:, :10]
    top_b = np.argsort(-(q_b @ index_b.T), axis=1)[:, :10]
    overlap = [len(set(x) & set(y)) / 10 for x, y in zip(top_a.tolist(), top_b.tolist(), strict=True)]
    hit1 = {name: float(np.mean([row[0] == src for row, src in zip(top.tolist(), sources, strict=True)]))
            for name, top in (("float32", top_a), ("int8", top_b))}
    # What any perturbation of int8's size costs on this index: float32's vectors plus isotropic noise of the
    # norm that gives the same mean cosine (1 - eps^2 / 2), ranked the same way.
    index_cos = float(np.mean(np.sum(index_a * index_b, axis=1)))
    eps = float(np.sqrt(max(0.0, 2 * (1 - index_cos))))
    rng = np.random.default_rng(0)
    dim = index_a.shape[1]
    noisy_index = _unit(index_a + rng.normal(0, eps / np.sqrt(dim), index_a.shape).astype(np.float32))
    noisy_q = _unit(q_a + rng.normal(0, eps / np.sqrt(dim), q_a.shape).astype(np.float32))
    top_n = np.argsort(-(noisy_q @ noisy_index.T), axis=1)[:, :10]
    noise_overlap = [len(set(x) & set(y)) / 10 for x, y in zip(top_a.tolist(), top_n.tolist(), strict=True)]
    ranked = np.sort(q_a @ index_a.T, axis=1)[:, ::-1]
    return {"passages": len(index_texts), "queries": len(query_texts),
            "top10_overlap": round(float(np.mean(overlap)), 4), "top10_overlap_min": round(float(min(overlap)), 2),
            "source_at_1": {k: round(v, 4) for k, v in hit1.items()},
            "index_cos_min": round(float(np.min(np.sum(index_a * index_b, axis=1))), 5),
            "index_cos_mean": round(index_cos, 5),
            "noise_same_cos_top10_overlap": round(float(np.mean(noise_overlap)), 4),
            "rank9_rank10_gap_median": round(float(np.median(ranked[:, 8] - ranked[:, 9])), 5)}


def quality(cache: Path, held_out: int, passages: int, queries: int) -> dict:
    spec = load_spec(default_model_dir())
    engines = {"float32": TorchEngine(spec, dtype="float32"),
               "int8": build_int8_engine(spec, num_threads=2, cache_root=cache)}
    pool = TokenizerPool(spec.path / "tokenizer.json", 2)
    texts = corpus(held_out, seed=HELD_OUT_SEED)
    a, b = (_encode(e, pool, texts, spec.max_length) for e in engines.values())
    cos = np.sum(a * b, axis=1)
    index_texts = corpus(passages, seed=PASSAGE_SEED)
    query_texts, sources = keyword_queries(index_texts, queries)
    real = retrieval_set(passages, queries)
    return {"held_out": held_out, "cos_min": round(float(cos.min()), 4), "cos_mean": round(float(cos.mean()), 4),
            "below_0_99": int((cos < 0.99).sum()),
            "random_vocabulary": retrieval(engines, pool, spec.max_length, index_texts, query_texts, sources),
            "prose": {"files_read": real["files"],
                      **retrieval(engines, pool, spec.max_length, real["passages"], real["queries"],
                                  real["sources"])}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=5_000, help="backfill texts per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--held-out", type=int, default=2_000)
    p.add_argument("--passages", type=int, default=10_000)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--quality-only", action="store_true", help="only the quality figures (no servers)")
    add_results_dir(p, "int8_server-cpu.jsonl")
    a = p.parse_args()

    if a.quality_only:
        with tempfile.TemporaryDirectory(prefix="embedfleet-int8-") as tmp:
            row = {"figure": "int8_quality", "model": MODEL,
                   "quality": quality(Path(tmp), a.held_out, a.passages, a.queries)}
        print(json.dumps(row))
        record("int8_server", row, results_dir=a.results_dir)
        return

    with tempfile.TemporaryDirectory(prefix="embedfleet-int8-") as tmp:
        cache = Path(tmp)
        started = time.perf_counter()
        build_int8_engine(load_spec(default_model_dir()), num_threads=2, cache_root=cache)
        build_s = time.perf_counter() - started
        texts = corpus(a.n)
        servers = {"float32": Server("--dtype", "float32"),
                   "int8": Server("--dtype", "int8", "--engine-cache-dir", str(cache))}
        try:
            rates: dict[str, list[float]] = {d: [] for d in servers}
            for _ in range(a.rounds):
                for dtype, server in servers.items():
                    got = asyncio.run(backfill(server.url, MODEL, texts, 64, 8))
                    rates[dtype].append(got["embeddings_per_s"])
            c1 = {d: asyncio.run(online(s.url, MODEL, 1, 300)) for d, s in servers.items()}
        finally:
            for server in servers.values():
                server.stop()
        roof = ceiling(a.n, "float32", 16384, 32)
        out = {"figure": "int8_server", "model": MODEL, "machine": platform.processor() or platform.machine(),
               "int8_build_s": round(build_s, 1),
               "backfill": {d: statistics.median(r) for d, r in rates.items()}, "backfill_rounds": rates,
               "ceiling_fp32": roof["embeddings_per_s"],
               "c1_p50_ms": {d: c["p50_ms"] for d, c in c1.items()} if "p50_ms" in c1["int8"] else c1}
        out["backfill_int8_over_fp32"] = round(out["backfill"]["int8"] / out["backfill"]["float32"], 2)
        out["backfill_int8_over_ceiling"] = round(out["backfill"]["int8"] / roof["embeddings_per_s"], 2)
        out["backfill_fp32_over_ceiling"] = round(out["backfill"]["float32"] / roof["embeddings_per_s"], 2)
        if "p50_ms" in c1["int8"]:
            out["c1_p50_int8_over_fp32"] = round(c1["int8"]["p50_ms"] / c1["float32"]["p50_ms"], 2)
        if not a.skip_quality:
            out["quality"] = quality(cache, a.held_out, a.passages, a.queries)
    line = json.dumps(out)
    print(line)
    record("int8_server", out, results_dir=a.results_dir)



if __name__ == "__main__":
    main()
