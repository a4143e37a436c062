"""bf16 on CPU against fp32, in process: the trade-off the --dtype flag offers."""

from __future__ import annotations

import numpy as np
import torch

from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from tests.runtime.test_embeddings_correct import TEXTS


def test_bfloat16_matches_float32():
    spec = load_spec(default_model_dir())
    pool = TokenizerPool(spec.path / "tokenizer.json", 1)
    batch = [t.ids for t in pool._encode_sync(TEXTS, spec.max_length, True, "right")]
    threads = torch.get_num_threads()
    fp32 = TorchEngine(spec, dtype="float32").embed(batch)
    bf16 = TorchEngine(spec, dtype="bfloat16").embed(batch)
    torch.set_num_threads(threads)
    a = fp32 / np.linalg.norm(fp32, axis=1, keepdims=True)
    b = bf16 / np.linalg.norm(bf16, axis=1, keepdims=True)
    cosine = (a * b).sum(axis=1)
    print(f"bf16 vs fp32 cosine: min {cosine.min():.6f} mean {cosine.mean():.6f}")
    assert bf16.dtype == np.float32
    assert cosine.min() >= 0.999
