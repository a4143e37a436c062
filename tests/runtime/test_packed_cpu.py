"""engines/packed_cpu.py: BERT embedders on packed sequences on CPU give the padded path's vectors, whatever
the mix of lengths; the length groups send every token's attention back to its own place; a query's batch
run inside a bulk batch's pause (preemption) leaves the bulk batch's answer as it was; bf16 keeps its promise
against float32; and the engine says when and why it does not run packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.engines.packed_cpu import MIN_WIDTH, CpuPackedEncoder, Groups
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir


@pytest.fixture(scope="module")
def engines() -> tuple[TorchEngine, TorchEngine]:
    spec = load_spec(default_model_dir())
    return TorchEngine(spec), TorchEngine(spec, packed=False)


def ids_of_lengths(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """[CLS] words [SEP] rows of the given lengths, drawn from the model's ordinary vocabulary."""
    rng = np.random.default_rng(seed)
    return [[101, *rng.integers(2000, 12000, max(0, n - 2)).tolist(), 102][:n] for n in lengths]


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_groups_gather_every_token_once_and_send_it_back(lengths):
    """Gathering the packed tokens into the groups' blocks and taking `back` returns the packed order; each
    block row holds one whole sequence, its padding masked."""
    groups = Groups(lengths)
    tokens = torch.arange(sum(lengths))
    blocks, starts = [], np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for rows, width, gather, mask in groups.blocks:
        block = tokens if gather is None else tokens.index_select(0, gather)
        assert block.numel() == rows * width
        grid = block.view(rows, width)
        valid = torch.ones(rows, width, dtype=torch.bool) if mask is None else mask.view(rows, width)
        for row in range(rows):
            n = int(valid[row].sum())
            assert valid[row, :n].all() and not valid[row, n:].any()  # real tokens first, then padding
            first = int(grid[row, 0])
            seq = int(np.searchsorted(starts, first))
            assert starts[seq] == first and lengths[seq] == n
            assert grid[row, :n].tolist() == list(range(first, first + n))
        assert width == int(valid.sum(1).max())  # no wider than its longest row
        blocks.append(block)
    out = torch.cat(blocks)
    if groups.back is not None:
        out = out.index_select(0, groups.back)
    assert out.tolist() == tokens.tolist()


def test_one_block_of_equal_lengths_is_not_gathered():
    assert [(b[0], b[1], b[2], b[3]) for b in Groups([7, 7, 7]).blocks] == [(3, 7, None, None)]
    assert Groups([7, 7, 7]).back is None
    widths = [width for _, width, _, _ in Groups([3, MIN_WIDTH, MIN_WIDTH + 1, 200]).blocks]
    assert widths == [MIN_WIDTH, MIN_WIDTH + 1, 200]  # groups by power-of-two width, each its own longest


@pytest.mark.parametrize("lengths", [[5], [9, 9, 9, 9], [1, 2, 31, 32, 33, 64, 65, 128, 129, 256],
                                     [256, 3, 40, 3, 120, 17, 256, 64], [2] * 32])
def test_packed_vectors_are_the_padded_vectors(engines, lengths):
    packed, padded = engines
    assert packed.runs_packed and isinstance(packed.packed, CpuPackedEncoder)
    assert not padded.runs_packed
    batch = ids_of_lengths(lengths, seed=len(lengths))
    np.testing.assert_allclose(packed.embed(batch), padded.embed(batch), rtol=0, atol=2e-5)


def test_a_batch_run_in_a_pause_leaves_the_paused_batch_as_it_was(engines):
    """Preemption runs a query's batch on the engine thread between two layers of a bulk batch: the
    query's staging and length groups must not overwrite the bulk batch's."""
    packed, _ = engines
    packed.embed(ids_of_lengths([256] * 8))  # a larger batch first, as a serving engine has seen
    # the query holds more tokens than the bulk batch: a shared staging buffer would lose the bulk's layout
    bulk, query = ids_of_lengths([20, 3, 9], seed=1), ids_of_lengths([60, 12], seed=2)
    want_bulk, want_query = packed.embed(bulk), packed.embed(query)
    got_query, paused = [], []

    def pause() -> None:
        if not paused:  # once (the query's own forward pass pauses too)
            paused.append(1)
            got_query.append(packed.embed(query))

    packed.packed.pause = pause
    try:
        got_bulk = packed.embed(bulk)
    finally:
        packed.packed.pause = None
    np.testing.assert_array_equal(got_bulk, want_bulk)
    np.testing.assert_array_equal(got_query[0], want_query)


def test_the_fused_projection_keeps_one_copy_of_the_weights(engines):
    packed, _ = engines
    for layer, (weight, _) in zip(packed.packed.layers, packed.packed.qkv, strict=True):
        att = layer.attention.self
        base = weight.untyped_storage().data_ptr()
        for m in (att.query, att.key, att.value):
            assert m.weight.untyped_storage().data_ptr() == base


@pytest.mark.usefixtures("cpu_bf16")
def test_packed_bfloat16_keeps_the_bfloat16_promise():
    """docs/runtime.md: bf16 on CPU has cosine >= 0.999 with float32."""
    spec = load_spec(default_model_dir())
    threads = torch.get_num_threads()
    bf16 = TorchEngine(spec, dtype="bfloat16")
    torch.set_num_threads(threads)
    assert bf16.runs_packed
    batch = ids_of_lengths([1, 2, 31, 33, 64, 65, 200, 256], seed=3)
    a, b = TorchEngine(spec, packed=False).embed(batch), bf16.embed(batch)
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cosine.min() >= 0.999


def test_where_it_does_not_run_packed_it_says_why():
    spec = load_spec(default_model_dir())
    assert TorchEngine(spec, packed=False).packed_reason == "--no-packed"
    reference = TorchEngine(spec, native=False)
    assert not reference.runs_packed and "native" in reference.packed_reason
