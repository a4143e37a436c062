"""The CUDA side of the torch engine: memory budget at start-up, pinned staging, device-side padding,
shape buckets for CUDA graphs.

A batch token budget that does not fit next to the weights would OOM in the middle of traffic,
on the first long batch. `batch_memory_bytes` estimates the activation peak of one forward at
the budget from the model config alone (a pure function, tested on CPU) and `check_memory_budget`
compares it with `torch.cuda.mem_get_info` once the weights are loaded, failing start-up with the
largest budget that would fit. `DeviceStager` ships only the real tokens (one flat int64 copy
from a reused pinned buffer, asynchronous) and builds the padded matrix and mask on the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 2}  # fp8 keeps activations bf16 between GEMMs
HEADROOM = 0.90  # leave 10% of free memory to the allocator's fragmentation and cuBLAS workspaces
SAFETY = 1.25  # multiplier over the counted tensors: temporaries we do not itemise
WORKSPACE_BYTES = 256 * 1024**2  # cuBLAS/cuBLASLt workspaces, SDPA scratch, CUDA context growth
GATED_ACTS = {"silu", "swiglu", "gelu_pytorch_tanh", "geglu"}
DECODER_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}


class MemoryBudgetError(RuntimeError):
    """The configured batch token budget cannot fit in the GPU's free memory."""


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def batch_memory_bytes(config: Any, max_batch_tokens: int, dtype: str) -> int:
    """Estimated peak activation memory of one forward over `max_batch_tokens` padded tokens.

    Inference frees each layer's activations before the next, so the peak is one layer's working
    set plus what lives across layers: the residual stream, the 4-D attention mask transformers
    builds ([batch, 1, seq, seq], at most tokens x max_len elements) and the fp32 copy pooling makes.
    SDPA's flash / memory-efficient kernels never materialise the seq x seq scores.
    """
    t = max_batch_tokens
    b = DTYPE_BYTES[dtype]
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads", None) or heads)
    head_dim = int(_get(config, "head_dim", None) or hidden // heads)
    inter = int(_get(config, "intermediate_size", None) or 4 * hidden)
    max_len = int(_get(config, "max_position_embeddings", None) or 512)
    act = str(_get(config, "hidden_act", "gelu"))
    gated = act in GATED_ACTS or str(_get(config, "model_type", "")) in DECODER_TYPES
    seq = min(max_len, t)

    residual = 3 * t * hidden * b  # layer input, attention output, residual sum
    qkv = t * (heads + 2 * kv_heads) * head_dim * b
    attn_out = t * heads * head_dim * b
    mlp = t * inter * b * (3 if gated else 2)  # gate and up (gated), activation output
    mask = t * seq * b  # expanded additive mask (at most tokens x longest-row elements)
    fp8_copies = t * max(hidden, inter) * 2 if dtype == "fp8" else 0  # e4m3 input + fp32 scales, one GEMM
    pooled = t * hidden * 4  # pool() works in fp32
    ids = t * 8 * 3  # ids, mask, positions as int64
    counted = residual + qkv + attn_out + mlp + mask + fp8_copies + pooled + ids
    return int(counted * SAFETY) + WORKSPACE_BYTES


def largest_fitting_budget(config: Any, dtype: str, free_bytes: int, step: int = 1024) -> int:
    """The largest multiple of `step` tokens whose estimate fits in `free_bytes` x HEADROOM (0 if none)."""
    usable = free_bytes * HEADROOM
    lo, hi = 0, 1
    while batch_memory_bytes(config, hi * step, dtype) <= usable and hi < 1 << 20:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if batch_memory_bytes(config, mid * step, dtype) <= usable:
            lo = mid
        else:
            hi = mid
    return lo * step


def check_memory_budget(config: Any, max_batch_tokens: int, dtype: str, free_bytes: int,
                        device_name: str = "the GPU") -> int:
    """Raise MemoryBudgetError (with a budget that fits) when the estimate exceeds free memory."""
    need = batch_memory_bytes(config, max_batch_tokens, dtype)
    if need > free_bytes * HEADROOM:
        fits = largest_fitting_budget(config, dtype, free_bytes)
        advice = (f"set --max-batch-tokens {fits} or lower" if fits else
                  "the weights leave no room for any batch: use a larger GPU or --dtype fp8")
        raise MemoryBudgetError(
            f"--max-batch-tokens {max_batch_tokens} needs about {need / GIB:.2f} GiB of activation memory "
            f"in {dtype}, but only {free_bytes / GIB:.2f} GiB is free on {device_name} after loading the "
            f"weights (using at most {HEADROOM:.0%} of it); {advice}")
    return need


def check_cuda_memory(config: Any, max_batch_tokens: int, dtype: str, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    need = check_memory_budget(config, max_batch_tokens, dtype, free, torch.cuda.get_device_name(device))
    log.info("batch budget %d tokens: ~%.2f GiB activations, %.2f of %.2f GiB free", max_batch_tokens,
             need / GIB, free / GIB, total / GIB)
    return need


# -- shapes -----------------------------------------------------------------------------------
def bucket(n: int, cap: int, floor: int = 16) -> int:
    """n rounded up to the next power of two (at least `floor`), never above `cap` (unless n is)."""
    size = floor
    while size < n:
        size *= 2
    return max(min(size, cap), n)


def bucket_shape(rows: int, width: int, max_rows: int, max_width: int) -> tuple[int, int]:
    """A few shapes instead of every (rows, width): each shape is one captured CUDA graph."""
    return bucket(rows, max_rows, floor=1), bucket(width, max_width)


def served_shapes(max_rows: int, max_width: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every bucketed (rows, width) a batch can have: rows <= max_rows (--max-batch-requests), width <=
    max_width (the model's limit), and padded tokens rows x width <= max_tokens (the planner's budget)
    before bucketing, except a lone input, which may be as long as the model allows. Each one is a CUDA
    graph to capture at start-up, so that live traffic never compiles (and never falls back to eager
    past torch.compile's recompile limit)."""
    def smallest(cap: int, floor: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for n in range(1, cap + 1):
            out.setdefault(bucket(n, cap, floor), n)
        return out

    rows, widths = smallest(max_rows, 1), smallest(max_width, 16)
    return sorted((r, w) for r, r0 in rows.items() for w, w0 in widths.items() if r0 == 1 or r0 * w0 <= max_tokens)


# -- staging ----------------------------------------------------------------------------------
class DeviceStager:
    """Batch -> padded device tensors, copying only real tokens.

    The pinned buffer is reused: the engine thread reads results back (a sync) before it stages
    the next batch, so no copy is ever in flight while the buffer is rewritten.
    """

    def __init__(self, device: torch.device, pad_id: int, bucket_to: tuple[int, int] | None = None) -> None:
        self.device = device
        self.pad_id = pad_id
        self.bucket_to = bucket_to  # (max_rows, max_width) when shapes are bucketed for CUDA graphs
        self.pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)

    def _host_buffer(self, n: int) -> torch.Tensor:
        if self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * self._host.numel()), dtype=torch.int64, pin_memory=self.pin)
        return self._host[:n]

    def __call__(self, batch: Sequence) -> dict[str, torch.Tensor]:
        seqs = [getattr(x, "ids", x) for x in batch]
        segments = [getattr(x, "type_ids", None) for x in batch]
        has_types = any(s is not None for s in segments)
        lengths = [len(s) for s in seqs]
        total = sum(lengths)
        rows, width = len(seqs), max(lengths)
        if self.bucket_to is not None:
            rows, width = bucket_shape(rows, width, *self.bucket_to)
        # one flat host array: ids, type ids, destination positions, row lengths; padding rows get
        # one token so no row is fully masked (that would make NaNs in SDPA)
        lengths = lengths + [1] * (rows - len(seqs))
        seqs = list(seqs) + [[self.pad_id]] * (rows - len(seqs))
        flat_n = total + rows - len(batch)
        parts = 3 if has_types else 2
        n = flat_n * parts + rows
        host = self._host_buffer(n)
        view = host.numpy()
        view[:flat_n] = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=flat_n)
        if has_types:
            types = [s if s is not None else [0] * len(q) for s, q in zip(segments, seqs, strict=False)]
            types += [[0]] * (rows - len(types))
            view[flat_n:2 * flat_n] = np.fromiter((t for s in types for t in s), dtype=np.int64, count=flat_n)
        lens = np.asarray(lengths, dtype=np.int64)
        row_starts = np.arange(rows, dtype=np.int64) * width
        # position of each real token in the padded [rows, width] matrix, computed here so the
        # device needs no boolean indexing (which would sync with the host)
        token_rank = np.arange(flat_n, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        view[(parts - 1) * flat_n:parts * flat_n] = np.repeat(row_starts, lens) + token_rank
        view[n - rows:n] = lens
        dev = host.to(self.device, non_blocking=True)
        where = dev[(parts - 1) * flat_n:parts * flat_n]
        mask = (torch.arange(width, device=self.device).unsqueeze(0) < dev[n - rows:n].unsqueeze(1))
        ids = torch.full((rows * width,), self.pad_id, dtype=torch.int64, device=self.device)
        ids[where] = dev[:flat_n]
        out = {"input_ids": ids.view(rows, width), "attention_mask": mask.to(torch.int64)}
        if has_types:
            type_ids = torch.zeros((rows * width,), dtype=torch.int64, device=self.device)
            type_ids[where] = dev[flat_n:2 * flat_n]
            out["token_type_ids"] = type_ids.view(rows, width)
        return out
