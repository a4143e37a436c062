"""CPU-checkable parts of the CUDA path: the memory budget estimate, device-side padding, shape buckets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import BertConfig, LlamaConfig

from embedfleet.runtime.engines.base import pad_batch
from embedfleet.runtime.engines.cuda import (
    GIB,
    HEADROOM,
    DeviceStager,
    MemoryBudgetError,
    batch_memory_bytes,
    bucket,
    bucket_shape,
    check_memory_budget,
    largest_fitting_budget,
)
from embedfleet.runtime.engines.quality_gate import PairInput

BGE_LARGE = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                       max_position_embeddings=512)
QWEN_06B = LlamaConfig(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, max_position_embeddings=32768, hidden_act="silu")


@pytest.mark.parametrize("config", [BGE_LARGE, QWEN_06B], ids=["bge-large", "qwen3-0.6b"])
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 200_000), st.integers(1, 200_000))
def test_estimate_grows_with_the_budget(config, a, b):
    lo, hi = sorted((a, b))
    assert batch_memory_bytes(config, lo, "bfloat16") <= batch_memory_bytes(config, hi, "bfloat16")


def test_estimate_magnitude_for_bge_large():
    """16k tokens of bge-large in bf16: the MLP alone is 16k x 4096 x 2 B x 2 = 256 MiB; the whole
    layer's working set with the mask and fp32 pooling lands between 0.5 and 2 GiB."""
    need = batch_memory_bytes(BGE_LARGE, 16384, "bfloat16")
    assert 0.5 * GIB < need < 2 * GIB
    assert batch_memory_bytes(BGE_LARGE, 16384, "float32") > need


def test_estimate_accepts_plain_dicts():
    as_dict = BGE_LARGE.to_dict()
    assert batch_memory_bytes(as_dict, 8192, "fp8") == batch_memory_bytes(BGE_LARGE, 8192, "fp8")


def test_gated_decoder_mlp_costs_more_than_plain():
    plain = LlamaConfig(**{**QWEN_06B.to_dict(), "model_type": "bert", "hidden_act": "gelu"})
    plain.model_type = "bert"
    assert batch_memory_bytes(QWEN_06B, 8192, "bfloat16") > batch_memory_bytes(plain, 8192, "bfloat16")


def test_budget_that_fits_passes_and_reports_need():
    need = check_memory_budget(BGE_LARGE, 16384, "bfloat16", free_bytes=40 * GIB, device_name="H100")
    assert need == batch_memory_bytes(BGE_LARGE, 16384, "bfloat16")


def test_budget_too_large_is_a_clear_error_with_a_budget_that_fits():
    free = 2 * GIB
    with pytest.raises(MemoryBudgetError) as err:
        check_memory_budget(QWEN_06B, 262144, "bfloat16", free_bytes=free, device_name="NVIDIA H100 80GB HBM3")
    msg = str(err.value)
    assert "--max-batch-tokens 262144" in msg and "NVIDIA H100 80GB HBM3" in msg
    fits = largest_fitting_budget(QWEN_06B, "bfloat16", free)
    assert f"set --max-batch-tokens {fits} or lower" in msg
    assert fits > 0 and fits % 1024 == 0
    assert batch_memory_bytes(QWEN_06B, fits, "bfloat16") <= free * HEADROOM
    assert batch_memory_bytes(QWEN_06B, fits + 1024, "bfloat16") > free * HEADROOM
    check_memory_budget(QWEN_06B, fits, "bfloat16", free_bytes=free)  # the advice itself fits


def test_no_room_at_all():
    with pytest.raises(MemoryBudgetError, match="no room for any batch"):
        check_memory_budget(BGE_LARGE, 1024, "bfloat16", free_bytes=64 * 1024**2)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5000), st.integers(16, 8192))
def test_bucket_rounds_up_to_powers_of_two(n, cap):
    b = bucket(n, cap)
    assert b >= n
    assert b == n or b == cap or (b & (b - 1) == 0 and b < 2 * max(n, 16))


def test_bucket_shape():
    assert bucket_shape(3, 70, max_rows=32, max_width=512) == (4, 128)
    assert bucket_shape(33, 600, max_rows=32, max_width=512) == (33, 600)  # beyond the caps: unchanged


batches = st.lists(st.lists(st.integers(1, 30000), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_device_padding_equals_host_padding(batch):
    stager = DeviceStager(torch.device("cpu"), pad_id=0)
    got = stager(batch)
    want = pad_batch(batch, 0)
    np.testing.assert_array_equal(got["input_ids"].numpy(), want.ids)
    np.testing.assert_array_equal(got["attention_mask"].numpy(), want.mask)
    assert "token_type_ids" not in got


def test_device_padding_with_segments_and_buffer_reuse():
    stager = DeviceStager(torch.device("cpu"), pad_id=1)
    pairs = [PairInput([101, 5, 6, 102, 7, 102], [0, 0, 0, 0, 1, 1]), PairInput([101, 9, 102], None)]
    for _ in range(2):  # second call reuses the staging buffer
        got = stager(pairs)
        want = pad_batch(pairs, 1)
        np.testing.assert_array_equal(got["input_ids"].numpy(), want.ids)
        np.testing.assert_array_equal(got["token_type_ids"].numpy(), want.type_ids)
    big = [[3] * 500]
    np.testing.assert_array_equal(stager(big)["input_ids"].numpy(), pad_batch(big, 1).ids)


def test_bucketed_staging_adds_rows_and_columns_without_empty_rows():
    stager = DeviceStager(torch.device("cpu"), pad_id=0, bucket_to=(64, 128))
    got = stager([[5, 6, 7], [8] * 20, [9]])
    assert tuple(got["input_ids"].shape) == (4, 32)
    assert got["attention_mask"].sum(dim=1).tolist() == [3, 20, 1, 1]  # the filler row has one token
    assert got["input_ids"][1, :20].tolist() == [8] * 20 and got["input_ids"][1, 20:].sum() == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(16, 1024), st.integers(512, 65536), st.data())
def test_every_shape_a_batch_can_take_is_captured_at_start_up(max_rows, max_width, max_tokens, data):
    """A batch the planner can make (rows <= --max-batch-requests, width <= the model's limit, padded
    tokens within the budget, or a lone input of any allowed length) lands on a captured shape, so live
    traffic never compiles; and the set stays small."""
    from embedfleet.runtime.engines.cuda import served_shapes

    shapes = set(served_shapes(max_rows, max_width, max_tokens))
    rows = data.draw(st.integers(1, max_rows))
    width = data.draw(st.integers(1, max_width))
    if rows == 1 or rows * width <= max_tokens:
        assert bucket_shape(rows, width, max_rows, max_width) in shapes
    assert len(shapes) <= (max_rows.bit_length() + 1) * (max_width.bit_length() + 1)


def test_served_shapes_for_the_default_limits_are_few():
    from embedfleet.runtime.engines.cuda import served_shapes

    shapes = served_shapes(32, 512, 16384)  # --max-batch-requests 32, a 512-token model, 16384 tokens
    assert (1, 512) in shapes and (32, 512) in shapes and (32, 16) in shapes
    assert len(shapes) == 36
