"""The OpenAI embeddings response body, built once for the sync route and the async worker."""

from __future__ import annotations

import numpy as np

from embedfleet.runtime.core.postprocess import finish, to_base64


def embeddings_body(model: str, rows: np.ndarray, tokens: int, dimensions: int | None,
                    encoding_format: str) -> dict:
    vectors = finish(rows, normalize=True, dimensions=dimensions)
    encode = to_base64 if encoding_format == "base64" else (lambda v: v)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
