"""BERT embedders over packed sequences on CPU: every linear layer on real tokens, attention by length group.

Why: on CPU the model's time is its matrix products, which cost each token they are given, padding
included. A server cannot sort a whole corpus by length the way an offline loop can: it batches what is
queued now (a backfill of 4 clients x 32 natural-order texts is 128 inputs), so its padded batches are
either short (few inputs of similar length, each paying the forward pass' fixed cost) or padded. Packed,
a batch is its real tokens laid end to end ([tokens, hidden]), so the batch planner fills each batch up to
its budget (core/batching.py: bulk inputs oldest first, queries with the inputs nearest them in length) and
neither padding nor extra batches are paid.

Attention is the one step that needs each sequence apart. CPU has no variable-length kernel, and one
SDPA call per sequence (engines/packed.py's fallback) costs ~40 us of dispatch per sequence and layer. Here
the batch's sequences are grouped by length (power-of-two widths from 32), each group gathered into a
padded [rows, heads, width, head_dim] block with one index, run through one SDPA call with a key mask, and
the results gathered back into packed order with one index for the whole batch. A group pads only its
attention, never the linear layers, and attention is a small share of a short-sequence model's work. A
group's rows are longer than half its width (all but the narrowest, whose rows are at most 32 tokens), so its
block holds less than twice its real tokens: the batch's attention memory stays within twice what its
token budget (`--max-batch-tokens`) gives padded rows of one length. A batch whose sequences already lie as
one block of equal lengths (a lone query) is not gathered at all.

The query, key and value projections run as one matrix product: their weights are rebound as views of
one [3 x hidden, hidden] tensor, so no second copy of them is held.

Every batch's state is its own (no shared staging buffer): with preemption a query's batch runs inside a
bulk batch's forward pass (`pause`, between layers), on the same thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.nn import functional

from embedfleet.runtime.engines.packed import PackedBatch, PackedEncoder, batch_from, pack_host

MIN_WIDTH = 32  # the narrowest length group: below it attention is a sliver of a layer's work


class Groups:
    """How a packed batch's attention runs: per group (rows, width, gather index into the packed tokens,
    key mask or None), and the index that takes the groups' outputs back to packed order (None: the batch
    is one block already in order)."""

    def __init__(self, lengths: list[int]) -> None:
        self.blocks: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        self.back: torch.Tensor | None = None
        if len(set(lengths)) == 1:  # one block [rows, length] in order: no gather, no mask
            self.blocks.append((len(lengths), lengths[0], None, None))
            return
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        by_width: dict[int, list[int]] = {}
        for seq, n in enumerate(lengths):
            width = MIN_WIDTH
            while width < n:
                width *= 2
            by_width.setdefault(width, []).append(seq)
        back = np.empty(int(sum(lengths)), dtype=np.int64)
        base = 0
        for _, seqs in sorted(by_width.items()):
            lens = np.asarray([lengths[s] for s in seqs])
            width = int(lens.max())
            pos = np.arange(width)
            valid = pos[None, :] < lens[:, None]  # [rows, width]
            # padding slots read token 0: any real token will do, the mask keeps them out of every sum
            gather = np.where(valid, starts[seqs][:, None] + pos[None, :], 0).reshape(-1)
            flat = np.flatnonzero(valid)
            back[gather[flat]] = flat + base
            base += len(seqs) * width
            mask = None if valid.all() else torch.from_numpy(valid[:, None, None, :].copy())
            self.blocks.append((len(seqs), width, torch.from_numpy(gather), mask))
        self.back = torch.from_numpy(back)


class CpuPackedEncoder(PackedEncoder):
    """engines/packed.py's encoder with CPU attention by length group, fused QKV and a pause between layers."""

    def __init__(self, model: torch.nn.Module, model_type: str, pooling: str) -> None:
        super().__init__(model, model_type, pooling, torch.device("cpu"))
        self.pause: Callable[[], None] | None = None  # set by TorchEngine.between_layers (preemption)
        self.hidden_size = self.heads * self.head_dim
        self.qkv = [self._fuse(layer.attention.self) for layer in self.layers]

    @staticmethod
    def _fuse(att: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """One [3h, h] weight and [3h] bias; the three Linear modules keep views of them."""
        mods = (att.query, att.key, att.value)
        weight = torch.cat([m.weight.detach() for m in mods]).contiguous()
        bias = torch.cat([m.bias.detach() for m in mods]).contiguous()
        h = mods[0].weight.shape[0]
        for i, m in enumerate(mods):
            m.weight = torch.nn.Parameter(weight[i * h:(i + 1) * h], requires_grad=False)
            m.bias = torch.nn.Parameter(bias[i * h:(i + 1) * h], requires_grad=False)
        return weight, bias

    def stage(self, batch: Sequence, tokens_to: int | None = None, segments_to: int | None = None) -> PackedBatch:
        """The batch in tensors of its own (the base class reuses one staging buffer, which a query's batch
        run during a preemption pause would overwrite under a bulk batch still in flight)."""
        arr, tokens, segments, longest = pack_host(batch, self.position_offset, tokens_to, segments_to)
        return batch_from(torch.from_numpy(arr), tokens, segments, longest, len(batch))

    def embed(self, batch: Sequence) -> torch.Tensor:
        b = self.stage(batch)
        groups = Groups([len(getattr(x, "ids", x)) for x in batch])
        x = self.embeddings(b)
        for i, layer in enumerate(self.layers):
            if i and self.pause is not None:
                self.pause()
            x = self._packed_layer(i, layer, x, groups)
        return self.pool(x, b)[: b.rows]

    def _packed_layer(self, i: int, layer: torch.nn.Module, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        weight, bias = self.qkv[i]
        qkv = torch.addmm(bias, x, weight.t())  # [tokens, 3h]: q | k | v
        heads, dim = self.heads, self.head_dim
        outs = []
        for rows, width, gather, mask in groups.blocks:
            block = qkv if gather is None else qkv.index_select(0, gather)
            q, k, v = block.view(rows, width, 3, heads, dim).permute(2, 0, 3, 1, 4)  # each [rows, heads, width, dim]
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            outs.append(out.transpose(1, 2).reshape(rows * width, self.hidden_size))
        ctx = outs[0] if len(outs) == 1 else torch.cat(outs)
        if groups.back is not None:
            ctx = ctx.index_select(0, groups.back)
        o = layer.attention.output
        h = o.LayerNorm(o.dense(ctx) + x)
        inner = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(h))
        return layer.output.LayerNorm(layer.output.dense(inner) + h)
