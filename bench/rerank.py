"""Rerank throughput: 1 query x 1,000 documents through the server vs the in-process ceiling.

The reranker is all-MiniLM-L6-v2's encoder with a (random) single-output head, saved as a
BertForSequenceClassification: the compute of a real MiniLM cross-encoder (ms-marco-MiniLM-L-6),
without a hub download. Prints one JSON line with pairs/s for both and their ratio (goal >= 0.9), also
appended to bench/results/rerank-cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import torch

from _common import Server, add_results_dir, corpus, record
from ceiling import packed
from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir


def build_reranker(root: Path) -> Path:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(str(default_model_dir()), num_labels=1)
    out = root / "minilm-reranker"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_dir() / name, out / name)
    return out


def ceiling(path: Path, query: str, docs: list[str], max_tokens: int, max_items: int) -> float:
    spec = load_spec(path)
    engine = TorchEngine(spec)
    engine.warmup()
    pool = TokenizerPool(path / "tokenizer.json", 2)
    start = time.perf_counter()
    pairs = pool._encode_pairs_sync([(query, d) for d in docs], spec.max_length, True, "right")
    for batch in packed(pairs, max_tokens, max_items):
        engine.classify(batch)
    return len(docs) / (time.perf_counter() - start)


def served(path: Path, query: str, docs: list[str], rounds: int) -> float:
    server = Server("--model", str(path))
    try:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            c.post("/rerank", json={"query": query, "texts": docs[:50]}).raise_for_status()
            start = time.perf_counter()
            for _ in range(rounds):
                ranked = c.post("/rerank", json={"query": query, "texts": docs}).json()
                assert len(ranked) == len(docs)
            return rounds * len(docs) / (time.perf_counter() - start)
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    add_results_dir(p, "rerank-cpu.jsonl")
    a = p.parse_args()
    docs = corpus(a.docs, seed=1)
    query = "which passage answers the question about embeddings"
    with tempfile.TemporaryDirectory() as tmp:
        path = build_reranker(Path(tmp))
        ceiling_rate = ceiling(path, query, docs, 16384, 32)
        server_rate = served(path, query, docs, a.rounds)
    row = {"figure": "rerank", "documents": a.docs, "ceiling_pairs_per_s": round(ceiling_rate, 1),
           "server_pairs_per_s": round(server_rate, 1), "server_over_ceiling": round(server_rate / ceiling_rate, 3)}
    print(json.dumps(row))
    record("rerank", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
