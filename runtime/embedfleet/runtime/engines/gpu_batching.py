"""Batching sized for the GPU: what `--device cuda` uses where the user set nothing.

The batching defaults (32 inputs, 16k tokens, 48 tokens of overhead per call) are measured on two CPU
cores, where a forward pass costs about its tokens. A GPU runs a 64-input batch and a 1,024-input
batch in nearly the same time: its fixed cost per call (kernel launches, the host's Python, one
synchronisation) is worth thousands of tokens, and batches must be large to amortise it. So on CUDA:

- the token budget is the largest that fits in the free memory left after the weights
  (engines/cuda.py's activation estimate), up to `MAX_GPU_BATCH_TOKENS`;
- inputs per batch follow the budget (`budget // TOKENS_PER_INPUT`, within `GPU_REQUESTS`): a batch
  of short queries fills the budget too;
- the per-call overhead is measured at start-up: the time of a one-input batch over the time per token
  of a large one (`overhead_tokens`), which is what the planner weighs padding against.

Each value the user set (flag or environment) is kept as given. The choice is logged at start-up and
shown in `/v1/models` (`batching`). Pure functions: property-tested on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from embedfleet.runtime.engines.cuda import MemoryBudgetError, largest_fitting_budget
from embedfleet.runtime.settings import MAX_OVERHEAD_TOKENS

MAX_GPU_BATCH_TOKENS = 65_536  # past this a batch takes long enough to delay queries for no throughput gain
MIN_GPU_BATCH_TOKENS = 4_096
TOKENS_PER_INPUT = 32  # a budget's worth of short inputs: inputs per batch = budget / this
GPU_REQUESTS = (64, 1024)  # inputs per batch, at least and at most


@dataclass(frozen=True)
class Batching:
    max_batch_tokens: int
    max_batch_requests: int
    batch_overhead_tokens: int
    chosen_by: dict[str, str]  # field -> "user" | "device" (what set it)

    def card(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return ", ".join(f"{k} {getattr(self, k)} ({v})" for k, v in self.chosen_by.items())


def gpu_budget(config: Any, dtype: str, free_bytes: int, max_length: int) -> int:
    """The token budget for one batch: what fits in free memory, at most MAX_GPU_BATCH_TOKENS and at least
    one input of the model's longest (a smaller budget could not serve a long input at all)."""
    fits = largest_fitting_budget(config, dtype, free_bytes)
    if fits <= 0:
        raise MemoryBudgetError(f"the weights leave no room for a batch on the GPU ({free_bytes / 2**30:.2f} GiB "
                                "free): use a larger GPU or --dtype fp8")
    return max(min(fits, MAX_GPU_BATCH_TOKENS), min(max(MIN_GPU_BATCH_TOKENS, max_length), fits))


def gpu_requests(max_batch_tokens: int) -> int:
    lo, hi = GPU_REQUESTS
    return max(1, min(max_batch_tokens, max(lo, min(hi, max_batch_tokens // TOKENS_PER_INPUT))))


def overhead_tokens(small_seconds: float, large_seconds: float, large_tokens: int, small_tokens: int = 1) -> int:
    """A call's fixed cost in tokens: the one-input batch's time over the per-token time of the large
    batch (its time beyond the small one's, per extra token). 0 when the measurements say nothing."""
    extra = large_tokens - small_tokens
    if extra <= 0 or large_seconds <= small_seconds or small_seconds <= 0:
        return 0
    per_token = (large_seconds - small_seconds) / extra
    return min(MAX_OVERHEAD_TOKENS, round(small_seconds / per_token))


def choose(user: Mapping[str, int], config: Any, dtype: str, free_bytes: int, max_length: int,
           overhead: int | None = None) -> Batching:
    """The batching a CUDA engine serves with: `user` holds the values the user set (only those),
    `overhead` the measured per-call overhead in tokens (None: not measured; keeps the user's or 0)."""
    budget = user.get("max_batch_tokens") or gpu_budget(config, dtype, free_bytes, max_length)
    requests = user.get("max_batch_requests") or gpu_requests(budget)
    over = user.get("batch_overhead_tokens")
    if over is None:
        over = overhead or 0
    by = {name: ("user" if name in user else "device")
          for name in ("max_batch_tokens", "max_batch_requests", "batch_overhead_tokens")}
    return Batching(int(budget), int(min(requests, budget)), int(over), by)
