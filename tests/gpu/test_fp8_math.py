"""FP8 maths on CPU: quantisation error bounds, scales, the emulated scaled matmul, Fp8Linear."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from embedfleet.runtime.engines.fp8 import (
    E4M3,
    E4M3_MAX,
    Fp8Linear,
    dequantize,
    quantize,
    quantize_activation,
    quantize_model,
    quantize_weight,
    restore_model,
    scaled_mm_emulated,
    transformer_layers,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal numbers; below
# the smallest normal (2^-6) the spacing is 2^-9, so the absolute error is at most 2^-10 (x scale)
REL_BOUND = 2.0**-4
SUBNORMAL_ABS_BOUND = 2.0**-10

matrices = st.tuples(st.integers(1, 24), st.integers(1, 48), st.integers(0, 2**31 - 1),
                     st.floats(1e-3, 1e3))


def random_matrix(rows: int, cols: int, seed: int, magnitude: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * magnitude
    x[0, 0] = 0.0  # zeros must survive
    return x


@settings(max_examples=60, deadline=None)
@given(matrices)
def test_weight_round_trip_within_e4m3_bounds(case):
    w = random_matrix(*case)
    q, scale = quantize_weight(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    back = dequantize(q, scale.unsqueeze(1))
    err = (back - w).abs()
    bound = torch.maximum(w.abs() * REL_BOUND, SUBNORMAL_ABS_BOUND * scale.unsqueeze(1)) * (1 + 1e-5)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert back[0, 0] == 0


@settings(max_examples=60, deadline=None)
@given(matrices)
def test_scales_map_each_row_max_onto_448(case):
    w = random_matrix(*case)
    q, scale = quantize_weight(w)
    amax = w.abs().amax(dim=1)
    nonzero = amax > 0
    assert torch.allclose(scale[nonzero], amax[nonzero] / E4M3_MAX)
    assert bool((q.float().abs().amax(dim=1)[nonzero] == E4M3_MAX).all())
    assert bool(torch.isfinite(q.float()).all())  # saturating: never inf or nan


def test_all_zero_row_gets_a_finite_scale_and_zeros():
    w = torch.zeros(3, 16)
    w[1] = torch.linspace(-1, 1, 16)
    q, scale = quantize_weight(w)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (q[0].float() == 0).all() and (q[2].float() == 0).all()


def test_activation_scales_per_token_and_per_tensor():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [100.0, 3.0, -7.0, 1.0]])
    _, per_token = quantize_activation(x, "token")
    _, per_tensor = quantize_activation(x, "tensor")
    assert per_token.shape == (2, 1) and per_tensor.shape == (2, 1)
    assert torch.allclose(per_token.squeeze(1), torch.tensor([2.0, 100.0]) / E4M3_MAX)
    assert torch.allclose(per_tensor.squeeze(1), torch.tensor([100.0, 100.0]) / E4M3_MAX)


def test_per_token_scaling_keeps_small_rows_accurate():
    """One outlier token must not flatten every other token to zero: why per-token is the default."""
    x = torch.randn(8, 64) * 0.01
    x[3] *= 1e5
    for scaling, expect_ok in (("token", True), ("tensor", False)):
        q, s = quantize_activation(x, scaling)
        rel = ((dequantize(q, s) - x).norm(dim=1) / x.norm(dim=1))
        assert bool((rel[[0, 1, 2, 4, 5, 6, 7]] < 0.05).all()) is expect_ok, (scaling, rel)


def test_saturation_instead_of_overflow():
    x = torch.tensor([[1e6, -1e6, 3.0]])
    q = quantize(x, torch.tensor([[1.0]]))
    assert q.float().tolist() == [[E4M3_MAX, -E4M3_MAX, 3.0]]


def test_emulated_scaled_mm_is_exact_for_representable_inputs():
    """Values on the e4m3 grid with power-of-two scales: the emulation must equal a plain matmul.

    (Magnitudes kept within a few octaves so the fp32 accumulation itself is exact.)"""
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, -2.0, 3.0, -0.25, 6.0, -0.875, 14.0])
    a = grid[torch.randint(0, len(grid), (7, 32), generator=g)]
    w = grid[torch.randint(0, len(grid), (16, 32), generator=g)]
    sa = torch.full((7, 1), 0.25)
    sw = 2.0 ** torch.randint(-4, 4, (16,), generator=g).float()
    out = scaled_mm_emulated(a.to(E4M3), sa, w.to(E4M3), sw, torch.float32)
    expected = (a.double() * 0.25) @ (w.double() * sw.double().unsqueeze(1)).t()
    assert torch.equal(out.double(), expected)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 16), st.sampled_from([16, 32, 64]), st.sampled_from([16, 48]), st.integers(0, 2**31 - 1))
def test_emulated_scaled_mm_tracks_plain_matmul(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    a, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    qa, sa = quantize_activation(a)
    qw, sw = quantize_weight(w)
    out = scaled_mm_emulated(qa, sa, qw, sw, torch.float32)
    exact = a @ w.t()
    # each product carries at most ~2 x 2^-4 relative error; random signs make the sum's error ~sqrt(k)
    bound = 2 * REL_BOUND * (a.abs() @ w.abs().t()) + 1e-6
    assert bool(((out - exact).abs() <= bound).all())
    cos = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0)
    assert cos > 0.99


def test_fp8_linear_matches_nn_linear():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    fp8 = Fp8Linear.from_linear(lin)
    x = torch.randn(2, 5, 64)
    y, ref = fp8(x), lin(x)
    assert y.shape == ref.shape == (2, 5, 48)
    rel = (y - ref).norm() / ref.norm()
    assert rel < 0.05, rel
    assert fp8.weight.dtype == E4M3 and fp8.weight.element_size() == 1


def test_fp8_linear_keeps_the_input_dtype():
    lin = nn.Linear(32, 16).to(torch.bfloat16)
    out = Fp8Linear.from_linear(lin)(torch.randn(3, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def _bert(task: str = "embed"):
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, num_labels=3)
    model = BertModel(cfg) if task == "embed" else BertForSequenceClassification(cfg)
    return model.eval()


def test_quantize_model_replaces_only_transformer_layer_linears():
    model = _bert("classify")
    name, _ = transformer_layers(model)
    assert name == "bert.encoder.layer"
    originals = quantize_model(model)
    assert len(originals) == 2 * 6  # q, k, v, attention out, intermediate, output per layer
    assert all(name.startswith("bert.encoder.layer.") for name in originals)
    assert isinstance(model.classifier, nn.Linear) and isinstance(model.bert.pooler.dense, nn.Linear)
    assert isinstance(model.bert.embeddings.word_embeddings, nn.Embedding)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 12
    restore_model(model, originals)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def test_fp8_bert_embeddings_close_to_full_precision():
    """The whole model, emulated FP8 vs fp32: the same vectors up to FP8 rounding."""
    model = _bert()
    ids = torch.randint(5, 500, (6, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[3:, 12:] = 0
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        quantize_model(model)
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
    cos = torch.nn.functional.cosine_similarity(ref, out, dim=1)
    assert cos.min() > 0.999, cos
    assert not torch.equal(ref, out)  # it really ran the quantised path


def test_decoder_layers_are_found():
    from transformers import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64))
    originals = quantize_model(model)
    assert {n.rsplit(".", 1)[-1] for n in originals} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"}
    assert isinstance(model.embed_tokens, nn.Embedding)


def test_model_without_layers_is_refused():
    with pytest.raises(ValueError, match="no stack of transformer layers"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)))


def test_round_trip_error_is_much_smaller_than_int8_saturation():
    """Sanity of the scale choice: the largest element of each row is reproduced almost exactly."""
    w = torch.randn(32, 64)
    q, s = quantize_weight(w)
    back = dequantize(q, s.unsqueeze(1))
    idx = w.abs().argmax(dim=1)
    np.testing.assert_allclose(back[torch.arange(32), idx].numpy(), w[torch.arange(32), idx].numpy(), rtol=1e-5)
