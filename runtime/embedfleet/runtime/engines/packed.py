"""BERT-family encoders over packed sequences: a batch costs its tokens, not rows x longest row.

A natural-order corpus mixes 8-token queries with 300-token passages; padded to its longest row, a batch
of them is mostly padding. Here the batch's real tokens are laid end to end as one [tokens, hidden]
matrix: every linear layer, norm and activation runs on real tokens only, and attention is the
variable-length FlashAttention kernel (`torch.nn.attention.varlen.varlen_attn`), which keeps each
sequence to itself through cumulative sequence offsets (`cu_seqlens`). Pooling reads the packed states
per segment. The weights are the transformers model's own modules, called in its order, so FP8
linears swapped in by engines/fp8.py run here too.

Where it applies: BERT, RoBERTa, XLM-R and CamemBERT encoders with absolute positions, embedding
task, on CUDA in bf16/fp16 (FlashAttention has no fp32 or CPU kernel). Everything else keeps the
padded transformers path. On CPU the attention falls back to one SDPA call per sequence: the tests
check the packed maths against transformers with it.

Small batches (a query or a few) are replayed as CUDA graphs: the forward of a 128-token query on a
24-layer model is ~300 kernel launches, which cost more host time than the GPU spends on them. Shapes
are bucketed (tokens, sequences) and captured at warm-up; each real segment keeps its own length, and
the bucket's spare tokens form one extra segment that pooling never reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch

log = logging.getLogger(__name__)

PACKED_TYPES = {"bert": 0, "roberta": 1, "xlm-roberta": 1, "camembert": 1}  # type -> positions offset by pad+1
GRAPH_TOKENS = (32, 64, 96, 128, 192, 256, 384, 512)  # token buckets captured as CUDA graphs
GRAPH_ROWS = (1, 2, 4, 8)  # sequence buckets captured as CUDA graphs


def packed_unsupported(model: torch.nn.Module, model_type: str, task: str, device: torch.device,
                       dtype: torch.dtype) -> str | None:
    """Why this model cannot run packed here (None: it can)."""
    if task != "embed":
        return f"task {task} keeps the padded path"
    if model_type not in PACKED_TYPES:
        return f"model type {model_type!r} has no packed path"
    if str(getattr(model.config, "position_embedding_type", "absolute")) != "absolute":
        return "only absolute position embeddings are packed"
    if device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        return "FlashAttention's variable-length kernel needs bfloat16 or float16"
    if device.type == "cuda":
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    for name in ("embeddings", "encoder"):
        if not hasattr(model, name):
            return f"{type(model).__name__} has no .{name}"
    return None


@dataclass
class PackedBatch:
    """One batch laid end to end, on the device. `segments` is how many sequences it holds (real ones
    first); `rows` how many of them are real inputs."""
    ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    type_ids: torch.Tensor  # [tokens] int64
    segment: torch.Tensor  # [tokens] int64: which sequence each token belongs to
    cu_seqlens: torch.Tensor  # [segments + 1] int32
    lengths: torch.Tensor  # [segments] float32
    max_len: int
    rows: int


def pack_host(batch: Sequence, position_offset: int, tokens_to: int | None = None,
              segments_to: int | None = None) -> tuple[np.ndarray, int, int, int]:
    """The batch as one int64 host array: ids | positions | type ids | segment of each token | cu_seqlens
    | lengths, laid out for a single host-to-device copy. With `tokens_to`/`segments_to` (a CUDA graph's
    bucket) the spare tokens form one extra segment after the real ones, and spare segments are one token
    each (no zero-length sequence reaches the kernel). Returns (array, tokens, segments, longest)."""
    seqs = [getattr(x, "ids", x) for x in batch]
    types = [getattr(x, "type_ids", None) for x in batch]
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    total = int(lens.sum())
    tokens, segments = tokens_to or total, segments_to or len(seqs)
    if segments_to:
        spare_segments = segments - len(seqs)
        pad_len = tokens - total - (spare_segments - 1)
        if spare_segments < 1 or pad_len < 1:
            raise ValueError(f"a bucket of {tokens} tokens and {segments} segments cannot hold {total} tokens "
                             f"in {len(seqs)} sequences plus a spare segment")
        lens = np.concatenate([lens, [pad_len], np.ones(spare_segments - 1, dtype=np.int64)])
    out = np.zeros(4 * tokens + (segments + 1) + segments, dtype=np.int64)
    out[:total] = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]) if seqs else []
    starts = np.cumsum(lens) - lens
    seg = np.repeat(np.arange(segments, dtype=np.int64), lens)
    out[tokens:2 * tokens] = np.arange(tokens, dtype=np.int64) - starts[seg] + position_offset
    out[tokens + total:2 * tokens] = position_offset  # spare segments: any valid position (never read)
    if any(t is not None for t in types):
        out[2 * tokens:2 * tokens + total] = np.concatenate(
            [np.asarray(t if t is not None else np.zeros(len(s)), dtype=np.int64) for t, s in zip(types, seqs,
                                                                                                   strict=True)])
    out[3 * tokens:4 * tokens] = seg
    out[4 * tokens:4 * tokens + segments + 1] = np.concatenate([[0], np.cumsum(lens)])
    out[4 * tokens + segments + 1:] = lens
    return out, tokens, segments, longest_bucket(int(lens.max()) if segments else 0)


def batch_from(staged: torch.Tensor, tokens: int, segments: int, longest: int, rows: int) -> PackedBatch:
    """The `PackedBatch` views of one staged `pack_host` array (`staged`, on the device it runs on)."""
    t, s = tokens, segments
    return PackedBatch(ids=staged[:t], positions=staged[t:2 * t], type_ids=staged[2 * t:3 * t],
                       segment=staged[3 * t:4 * t], cu_seqlens=staged[4 * t:4 * t + s + 1].to(torch.int32),
                       lengths=staged[4 * t + s + 1:].to(torch.float32), max_len=longest, rows=rows)


def longest_bucket(n: int) -> int:
    """The longest sequence as the kernel is told it: rounded up to a power of two (at least 64). Any bound
    at or above the real one is correct; a few distinct values keep torch.compile from specialising on
    every batch's own."""
    size = 64
    while size < n:
        size *= 2
    return size


class PackedEncoder:
    """The forward pass of a BERT-family encoder (transformers modules) over packed sequences."""

    def __init__(self, model: torch.nn.Module, model_type: str, pooling: str, device: torch.device,
                 compile: bool = False) -> None:
        self.model = model
        self.pooling = pooling
        self.device = device
        self.layers = list(model.encoder.layer)
        first = self.layers[0].attention.self
        self.heads = int(first.num_attention_heads)
        self.head_dim = int(first.attention_head_size)
        pad = int(model.config.pad_token_id or 0)
        self.position_offset = pad + 1 if PACKED_TYPES[model_type] else 0
        self.scale = self.head_dim ** -0.5
        self._host = torch.empty(0, dtype=torch.int64)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        # one compiled function serves every layer (their modules are its inputs); token counts vary, so
        # the token dimension is dynamic from the start instead of recompiled per batch
        self._layer_fn = torch.compile(self._layer, dynamic=True) if compile else self._layer

    # -- staging ------------------------------------------------------------------------------
    def stage(self, batch: Sequence, tokens_to: int | None = None, segments_to: int | None = None) -> PackedBatch:
        arr, tokens, segments, longest = pack_host(batch, self.position_offset, tokens_to, segments_to)
        host = self._pinned(arr.size)
        host.numpy()[:] = arr
        return batch_from(host.to(self.device, non_blocking=True), tokens, segments, longest, len(batch))

    def _pinned(self, n: int) -> torch.Tensor:
        """A reused host buffer (pinned on CUDA). Rewriting it is safe: the engine thread reads each batch's
        results back, a synchronisation, before it stages the next one."""
        if self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * self._host.numel()), dtype=torch.int64,
                                     pin_memory=self.device.type == "cuda")
        return self._host[:n]

    # -- forward ------------------------------------------------------------------------------
    def hidden(self, b: PackedBatch) -> torch.Tensor:
        """Token states [tokens, hidden] of the packed batch."""
        x = self.embeddings(b)
        for layer in self.layers:
            x = self._layer_fn(layer, x, b.cu_seqlens, b.max_len)
        return x

    def embeddings(self, b: PackedBatch) -> torch.Tensor:
        """The embedding layer's output [tokens, hidden]: word, position and (where the model has them) type."""
        emb = self.model.embeddings
        x = emb.word_embeddings(b.ids) + emb.position_embeddings(b.positions)
        if getattr(emb, "token_type_embeddings", None) is not None:
            x = x + emb.token_type_embeddings(b.type_ids)
        return emb.LayerNorm(x)

    def _layer(self, layer: torch.nn.Module, x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
        att = layer.attention.self
        t = x.shape[0]
        q = att.query(x).view(t, self.heads, self.head_dim)
        k = att.key(x).view(t, self.heads, self.head_dim)
        v = att.value(x).view(t, self.heads, self.head_dim)
        ctx = self._attention(q, k, v, cu_seqlens, max_len).reshape(t, self.heads * self.head_dim)
        out = layer.attention.output
        h = out.LayerNorm(out.dense(ctx) + x)
        inner = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(h))
        return layer.output.LayerNorm(layer.output.dense(inner) + h)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   max_len: int) -> torch.Tensor:
        if q.is_cuda:
            from torch.nn.attention.varlen import varlen_attn

            # positional arguments only: the keywords changed between torch releases; the default scale
            # is 1 / sqrt(head_dim), BERT's
            return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len)
        # CPU (tests): each sequence on its own, the same maths without the fused kernel
        cu = cu_seqlens.tolist()
        out = torch.empty_like(q)
        for lo, hi in pairwise(cu):
            qs, ks, vs = (z[lo:hi].transpose(0, 1) for z in (q, k, v))
            out[lo:hi] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=self.scale).transpose(0, 1)
        return out

    def pool(self, hidden: torch.Tensor, b: PackedBatch) -> torch.Tensor:
        """One float32 vector per segment (all segments; callers keep the first `rows`)."""
        hidden = hidden.float()
        segments = b.lengths.shape[0]
        if self.pooling == "cls":
            return hidden[b.cu_seqlens[:-1].long()]
        if self.pooling == "last":
            return hidden[b.cu_seqlens[1:].long() - 1]
        if self.pooling == "max":
            out = torch.full((segments, hidden.shape[1]), float("-inf"), device=hidden.device)
            return out.scatter_reduce_(0, b.segment.unsqueeze(1).expand_as(hidden), hidden, "amax")
        sums = torch.zeros((segments, hidden.shape[1]), device=hidden.device).index_add_(0, b.segment, hidden)
        return sums / b.lengths.clamp(min=1.0).unsqueeze(1)

    def embed(self, batch: Sequence) -> torch.Tensor:
        """Pooled float32 vectors [rows, hidden] on the device (a graph's replay when one fits)."""
        graph = self._graph_for(batch)
        if graph is not None:
            return graph.run(self, batch)
        b = self.stage(batch)
        return self.pool(self.hidden(b), b)[: b.rows]

    # -- CUDA graphs ----------------------------------------------------------------------------
    def graph_buckets(self, max_tokens: int) -> list[tuple[int, int]]:
        """(tokens, segments) shapes captured: GRAPH_TOKENS up to max_tokens, GRAPH_ROWS + 1 spare segment."""
        return [(t, r + 1) for t in GRAPH_TOKENS if t <= max_tokens for r in GRAPH_ROWS if r < t]

    def _graph_for(self, batch: Sequence) -> _Graph | None:
        if not self._graphs:
            return None
        total = sum(len(getattr(x, "ids", x)) for x in batch)
        for (tokens, segments), graph in self._graphs.items():  # ordered smallest first
            if segments - 1 >= len(batch) and tokens >= total + segments - len(batch):
                return graph
        return None

    def capture_graphs(self, max_tokens: int) -> int:
        """Capture every small bucket (largest first, so all share the largest one's memory pool)."""
        if self.device.type != "cuda":
            return 0
        pool = torch.cuda.graph_pool_handle()
        captured = {}
        for tokens, segments in sorted(self.graph_buckets(max_tokens), reverse=True):
            captured[(tokens, segments)] = _Graph(self, tokens, segments, pool)
        self._graphs = dict(sorted(captured.items(), key=lambda kv: (kv[0][0], kv[0][1])))
        return len(self._graphs)


class _Graph:
    """One captured (tokens, segments) bucket: static device inputs, the pooled output, the graph."""

    def __init__(self, enc: PackedEncoder, tokens: int, segments: int, pool) -> None:
        self.tokens, self.segments = tokens, segments
        dummy = [[enc.position_offset + 5] * 1]  # a one-token input; the spare segment takes the rest
        self.static = enc.stage(dummy, tokens, segments)
        self.static.max_len = tokens  # the kernel's grid is sized for any sequence in the bucket
        self.static.ids = self.static.ids.clone()
        for name in ("positions", "type_ids", "segment", "cu_seqlens", "lengths"):
            setattr(self.static, name, getattr(self.static, name).clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up off the capture: lazy inits, cuBLAS handles, FP8 kernel choice
                enc.pool(enc.hidden(self.static), self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = enc.pool(enc.hidden(self.static), self.static)

    def run(self, enc: PackedEncoder, batch: Sequence) -> torch.Tensor:
        fresh = enc.stage(batch, self.tokens, self.segments)
        s = self.static
        for name in ("ids", "positions", "type_ids", "segment", "cu_seqlens", "lengths"):
            getattr(s, name).copy_(getattr(fresh, name), non_blocking=True)
        self.graph.replay()
        return self.out[: len(batch)]
