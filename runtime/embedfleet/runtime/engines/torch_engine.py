"""PyTorch engine: transformers' model classes, SDPA attention, inference mode.

Runs on one dedicated thread (the batch manager's), so torch's intra-op pool owns the cores.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from embedfleet.runtime.engines.base import Capabilities, pad_batch
from embedfleet.runtime.models.spec import ModelSpec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineError(RuntimeError):
    pass


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Pool token states to one vector per input, in float32 for accuracy."""
    hidden = hidden.float()
    if how == "cls":
        return hidden[:, 0]
    if how == "last":
        last = mask.sum(dim=1) - 1  # right padding: the last real token
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if how == "max":
        return hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


class TorchEngine:
    def __init__(self, spec: ModelSpec, device: str = "cpu", dtype: str = "float32",
                 num_threads: int = 0) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification

        if dtype not in DTYPES:
            raise EngineError(f"dtype {dtype!r} is not supported by the torch engine on {device}")
        if device == "cuda" and not torch.cuda.is_available():
            raise EngineError("device 'cuda' requested but torch sees no CUDA device")
        if dtype == "float16" and device == "cpu":
            raise EngineError("float16 on CPU is slow and inaccurate; use bfloat16 or float32")
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        loader = AutoModel if spec.task == "embed" else AutoModelForSequenceClassification
        self.model = loader.from_pretrained(
            str(spec.path), dtype=self.dtype, attn_implementation="sdpa", local_files_only=True,
        ).to(self.device).eval()
        if spec.task != "embed" and self.model.config.pad_token_id is None:
            # decoder classifiers find each row's last token through the pad id
            self.model.config.pad_token_id = spec.pad_token_id
        self.capabilities = Capabilities(
            tasks=(spec.task,), pooling=spec.pooling, max_tokens=spec.max_length,
            dtypes=tuple(DTYPES), device=device, dim=spec.hidden_size if spec.task == "embed" else len(spec.labels))

    def warmup(self) -> None:
        run = self.embed if self.spec.task == "embed" else self.classify
        run([[self.spec.pad_token_id + 1] * 8, [self.spec.pad_token_id + 1] * 3])

    def _inputs(self, batch: list) -> dict[str, torch.Tensor]:
        padded = pad_batch(batch, self.spec.pad_token_id)
        inputs = {"input_ids": torch.from_numpy(padded.ids).to(self.device, non_blocking=True),
                  "attention_mask": torch.from_numpy(padded.mask).to(self.device, non_blocking=True)}
        if padded.type_ids is not None:
            inputs["token_type_ids"] = torch.from_numpy(padded.type_ids).to(self.device, non_blocking=True)
        return inputs

    @torch.inference_mode()
    def embed(self, batch: list) -> np.ndarray:
        inputs = self._inputs(batch)
        hidden = self.model(**inputs).last_hidden_state
        return pool(hidden, inputs["attention_mask"], self.spec.pooling).cpu().numpy()

    @torch.inference_mode()
    def classify(self, batch: list) -> np.ndarray:
        return self.model(**self._inputs(batch)).logits.float().cpu().numpy()
