"""MPNet (the family of all-mpnet-base-v2) is served: transformers has no SDPA attention for it, so the torch
engine loads its eager attention instead of failing at start-up, and the vectors are transformers' own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from tests.tiny_models import encoder_family_embedder


def test_an_mpnet_embedder_loads_and_embeds_as_transformers_does(tmp_path: Path) -> None:
    from transformers import MPNetModel

    path = encoder_family_embedder(tmp_path, "mpnet")
    spec = load_spec(path)
    engine = TorchEngine(spec, dtype="float32")
    assert engine.model.config._attn_implementation == "eager"
    batch = [[1, 40, 41, 42, 2], [1, 50, 2]]
    got = engine.embed(batch)

    reference = MPNetModel.from_pretrained(str(path), attn_implementation="eager").eval()
    for row, ids in zip(got, batch, strict=True):
        with torch.no_grad():
            states = reference(input_ids=torch.tensor([ids])).last_hidden_state[0]
        want = states.mean(dim=0).numpy()
        cos = float(np.dot(row, want) / (np.linalg.norm(row) * np.linalg.norm(want)))
        assert cos > 0.99999, cos


def test_mpnet_positions_are_offset_like_roberta(tmp_path: Path) -> None:
    path = encoder_family_embedder(tmp_path, "mpnet")
    (path / "sentence_bert_config.json").unlink()  # no sentence-transformers cap: the model's own
    assert load_spec(path).max_length == 130 - 2
