"""SPLADE weights to what the client asked for: the non-zero terms, optionally only the top k.

The engine returns one dense vocabulary-sized row per input (engines/torch_engine.splade_pool); the
wire carries only the terms with weight > 0. TEI lists them by token id ascending (the order of its
scan of the row), and so do we, whether or not `top_k` pruned the row first: pruning chooses which
terms stay, never their order.
"""

from __future__ import annotations

import numpy as np


def sparsify(row: np.ndarray, top_k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids ascending, their weights) of the row's positive terms; with `top_k`, the k heaviest
    (ties broken by the lower token id, so the answer does not depend on the sort's stability)."""
    indices = np.flatnonzero(row > 0)
    values = row[indices]
    if top_k is not None and len(indices) > top_k:
        keep = np.lexsort((indices, -values))[:top_k]
        keep.sort()
        indices, values = indices[keep], values[keep]
    return indices, values.astype(np.float32, copy=False)


def tei_sparse(rows: np.ndarray, top_k: int | None) -> list[list[dict]]:
    """TEI's /embed_sparse body: per input, [{"index": token_id, "value": weight}, ...]."""
    out = []
    for row in rows:
        indices, values = sparsify(row, top_k)
        out.append([{"index": int(i), "value": float(v)} for i, v in zip(indices, values, strict=True)])
    return out


def openai_sparse(model: str, rows: np.ndarray, tokens: int, top_k: int | None) -> dict:
    """/v1/embeddings for a sparse model: each item's `embedding` is {"indices": [...], "values": [...]}."""
    data = []
    for i, row in enumerate(rows):
        indices, values = sparsify(row, top_k)
        data.append({"object": "embedding", "index": i,
                     "embedding": {"indices": indices.tolist(), "values": values.tolist()}})
    return {"object": "list", "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
