"""The in-process ceiling: the same model with no HTTP, corpus sorted by length, packed by token budget.

Prints one JSON line, also appended to bench/results/ceiling-cpu.jsonl: embeddings/s and tokens/s end to
end (tokenize + forward) and forward only, plus the single-query time (tokenize + forward of one short query).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import add_results_dir, corpus, record
from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir


def packed(batch_ids: list[list[int]], max_tokens: int, max_items: int) -> list[list[list[int]]]:
    order = sorted(batch_ids, key=len)
    batches, current = [], []
    for ids in order:
        if current and (len(ids) * (len(current) + 1) > max_tokens or len(current) >= max_items):
            batches.append(current)
            current = []
        current.append(ids)
    return [*batches, current] if current else batches


def measure(n: int, dtype: str, max_tokens: int, max_items: int) -> dict:
    texts = corpus(n)
    spec = load_spec(default_model_dir())
    engine = TorchEngine(spec, dtype=dtype)
    engine.warmup()
    pool = TokenizerPool(spec.path / "tokenizer.json", 2)

    start = time.perf_counter()
    ids = [t.ids for t in pool._encode_sync(texts, spec.max_length, True, "right")]
    tokenized = time.perf_counter()
    for batch in packed(ids, max_tokens, max_items):
        engine.embed(batch)
    done = time.perf_counter()
    tokens = sum(map(len, ids))

    query = "how do I reset my password"
    single = []
    for i in range(120):
        t0 = time.perf_counter()
        engine.embed([pool._encode_sync([query], spec.max_length, True, "right")[0].ids])
        if i >= 20:
            single.append(time.perf_counter() - t0)
    return {
        "figure": "ceiling", "model": spec.name, "dtype": dtype, "inputs": n, "tokens": tokens,
        "max_batch_tokens": max_tokens, "max_batch_requests": max_items,
        "embeddings_per_s": round(n / (done - start), 2), "tokens_per_s": round(tokens / (done - start), 1),
        "forward_only_embeddings_per_s": round(n / (done - tokenized), 2),
        "single_query_ms": round(statistics.median(single) * 1000, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--max-batch-requests", type=int, default=32)
    add_results_dir(p, "ceiling-cpu.jsonl")
    a = p.parse_args()
    row = measure(a.n, a.dtype, a.max_batch_tokens, a.max_batch_requests)
    print(json.dumps(row))
    record("ceiling", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
