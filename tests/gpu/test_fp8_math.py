"""FP8 maths on CPU: quantisation error bounds, scales, the emulated scaled matmul, Fp8Linear, and the
bound the Hopper kernel is held to against the emulation (scaled_mm_tolerance, used by test_on_gpu.py)."""

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

U_FP32 = 2.0**-24  # float32's unit roundoff
# Hopper's FP8 tensor cores do not accumulate in full fp32. Each MMA instruction (32 products along K)
# aligns its products and the running partial sum to the largest of them and keeps about 13 bits below
# that one's leading bit (the "about 14 bits" of the DeepSeek-V3 report, section 3.3.2), truncating;
# cuBLAS/CUTLASS add the partial sum into a true fp32 accumulator every 4 instructions (128 products).
# Measured on an H200 (torch 2.11, 1024 x 1024 outputs per K), |kernel - exact| / sum_k |a_k||w_k| peaks
# at 2^-11.8 for the row-wise kernel and 2^-10.3 for the tensor-wise one, with heavy-tailed activations
# at K = 128-384; _tensor_core_stand_in below, which does exactly that truncation, reaches 2^-10.0 on
# CPU. The bound allows twice that. The fp32-order bound alone (K * 2^-24) refused 28 of 1.5M correct
# elements at K = 384 on the H200.
TENSOR_CORE_ACCUMULATION = 2.0**-9
BF16_HALF_ULP = 2.0**-8  # round-to-nearest into bf16 (8 significant bits) moves a value by at most 2^-8 of it

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


def scaled_mm_tolerance(qa: torch.Tensor, sa: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
                        emulated: torch.Tensor) -> torch.Tensor:
    """Per element, how far a bf16 output of `_scaled_mm(qa, qw.t(), sa, sw)` may lie from the fp32
    emulation `emulated` of the same FP8 operands.

    Why this and not a flat atol/rtol: both sum the same e4m3 products (exact in fp32), differently. The
    emulation's fp32 sum is within K * 2^-24 * sum_k |a_k||w_k| of the exact one; the kernel's within
    TENSOR_CORE_ACCUMULATION * sum_k |a_k||w_k| (its truncating accumulation, measured above); the scales
    multiply both and add roundings of their own (4 * 2^-24 of the value). The kernel then rounds to bf16:
    at most 2^-8 of its value, which is the emulated value give or take the accumulation error. A near-zero
    result of large cancelling terms may so differ by more than a flat atol allows, while a large one must
    agree to about 2^-8 of itself."""
    k = qa.shape[1]
    abs_sum = qa.float().abs() @ qw.float().abs().t()  # sum_k |a_k||w_k| in e4m3 units
    scale = sa.float() * sw.float().unsqueeze(0)
    accumulation = (k * U_FP32 + TENSOR_CORE_ACCUMULATION) * abs_sum * scale
    magnitude = emulated.float().abs()
    return accumulation + 4 * U_FP32 * magnitude + BF16_HALF_ULP * (magnitude + accumulation)


def _kernel_stand_in(qa, sa, qw, sw, chunk: int | None = None, acc=None) -> torch.Tensor:
    """What a correct kernel may return, computed on CPU: the exact sum (float64), fp32 partial sums over
    `chunk`-wide slices of K added in reverse order (another tiling), or a given accumulator `acc`; scales
    in fp32; bf16 out."""
    a, w = qa.float(), qw.float()
    if acc is None and chunk is None:
        acc = (a.double() @ w.double().t()).float()
    elif acc is None:
        acc = torch.zeros(a.shape[0], w.shape[0])
        for start in reversed(range(0, a.shape[1], chunk)):
            acc += a[:, start:start + chunk] @ w[:, start:start + chunk].t()
    return (acc.float() * sa * sw.unsqueeze(0)).to(torch.bfloat16).float()


def _tensor_core_stand_in(qa, qw, bits: int = 13, group: int = 32, promote: int = 4) -> torch.Tensor:
    """The Hopper FP8 accumulation as TENSOR_CORE_ACCUMULATION describes it: per instruction of `group`
    products, every addend (and the running partial sum) truncated to `bits` bits below the largest one's
    leading bit, the partial sum added into fp32 every `promote` instructions. Returns the fp32 sums."""
    a, w = qa.double(), qw.double()
    total = torch.zeros(a.shape[0], w.shape[0])
    partial = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64)
    for i, start in enumerate(range(0, a.shape[1], group)):
        products = a[:, None, start:start + group] * w[None, :, start:start + group]
        largest = torch.maximum(partial.abs(), products.abs().amax(-1)).clamp(min=1e-300)
        quantum = torch.exp2(torch.floor(torch.log2(largest)) - bits)
        partial = torch.trunc(partial / quantum) * quantum + \
            (torch.trunc(products / quantum[..., None]) * quantum[..., None]).sum(-1)
        if (i + 1) % promote == 0:
            total += partial.float()
            partial.zero_()
    return total + partial.float()


def _fp8_operands(m: int, k: int, n: int, seed: int, heavy_tailed: bool = False):
    """Random bf16 operands quantised as the engine does; `heavy_tailed`: activations times a log-normal
    factor, so a few products dominate each sum (outlier channels, as in real transformer layers)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    if heavy_tailed:
        a = a * torch.exp(torch.randn(m, k, generator=g))
    w = torch.randn(n, k, generator=g)
    return (*quantize_activation(a.to(torch.bfloat16)), *quantize_weight(w.to(torch.bfloat16)))


def _beyond(kernel: torch.Tensor, emulated: torch.Tensor, bound: torch.Tensor) -> int:
    return int(((kernel - emulated).abs() > bound).sum())


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 48), st.sampled_from([16, 64, 256, 1024, 4096]), st.sampled_from([16, 48, 128]),
       st.sampled_from(["exact", "tiles", "tensor cores"]), st.integers(0, 2**31 - 1))
def test_tolerance_admits_every_correct_accumulation(m, k, n, how, seed):
    qa, sa, qw, sw = _fp8_operands(m, k, n, seed)
    emulated = scaled_mm_emulated(qa, sa, qw, sw, torch.float32)
    if how == "tensor cores":
        kernel = _kernel_stand_in(qa, sa, qw, sw, acc=_tensor_core_stand_in(qa, qw))
    else:
        kernel = _kernel_stand_in(qa, sa, qw, sw, chunk=32 if how == "tiles" else None)
    assert _beyond(kernel, emulated, scaled_mm_tolerance(qa, sa, qw, sw, emulated)) == 0


@pytest.mark.parametrize("k", [64, 128, 384])
def test_tolerance_admits_the_tensor_cores_on_heavy_tailed_activations(k):
    """Where the truncating accumulation loses most (2^-10.3 of sum |a||w| measured on an H200), far
    beyond what an fp32-only bound (K * 2^-24) allows."""
    qa, sa, qw, sw = _fp8_operands(256, k, 128, k, heavy_tailed=True)
    acc = _tensor_core_stand_in(qa, qw)
    exact = qa.double() @ qw.double().t()
    abs_sum = qa.double().abs() @ qw.double().abs().t()
    loss = float(((acc.double() - exact).abs() / abs_sum).max())
    assert 2 * k * U_FP32 < loss <= TENSOR_CORE_ACCUMULATION
    emulated = scaled_mm_emulated(qa, sa, qw, sw, torch.float32)
    bound = scaled_mm_tolerance(qa, sa, qw, sw, emulated)
    assert _beyond(_kernel_stand_in(qa, sa, qw, sw, acc=acc), emulated, bound) == 0


def test_tolerance_catches_wrong_scales():
    """3% off in one output channel's scale, or 2% off in all of them."""
    qa, sa, qw, sw = _fp8_operands(300, 1024, 256, 0)
    emulated = scaled_mm_emulated(qa, sa, qw, sw, torch.float32)
    bound = scaled_mm_tolerance(qa, sa, qw, sw, emulated)
    assert _beyond(_kernel_stand_in(qa, sa, qw, sw, acc=_tensor_core_stand_in(qa, qw)), emulated, bound) == 0
    one = sw.clone()
    one[17] *= 1.03
    assert _beyond(_kernel_stand_in(qa, sa, qw, one)[:, 17:18], emulated[:, 17:18], bound[:, 17:18]) > 0
    assert _beyond(_kernel_stand_in(qa, sa, qw, sw * 1.02), emulated, bound) > 0


def test_tolerance_catches_one_flipped_weight():
    """The largest weight of one output channel with its sign flipped (a wrong operand layout or a lost
    bit looks like this): rows of that channel, and only of that channel, fall outside."""
    qa, sa, qw, sw = _fp8_operands(300, 1024, 256, 1)
    emulated = scaled_mm_emulated(qa, sa, qw, sw, torch.float32)
    bound = scaled_mm_tolerance(qa, sa, qw, sw, emulated)
    flipped = qw.clone()
    col = int(qw[5].float().abs().argmax())
    flipped[5, col] = (-qw[5, col].float()).to(E4M3)
    kernel = _kernel_stand_in(qa, sa, flipped, sw, chunk=32)
    beyond = _beyond(kernel, emulated, bound)
    assert beyond > 0 and beyond == _beyond(kernel[:, 5:6], emulated[:, 5:6], bound[:, 5:6])


def test_tolerance_catches_a_bf16_accumulator():
    """A kernel that keeps its running sum in bf16 (the wrong accumulator type) loses 2^-8 per product,
    or per instruction of 8."""
    qa, sa, qw, sw = _fp8_operands(300, 1024, 256, 2)
    emulated = scaled_mm_emulated(qa, sa, qw, sw, torch.float32)
    bound = scaled_mm_tolerance(qa, sa, qw, sw, emulated)
    for step in (1, 8):
        acc = torch.zeros(300, 256, dtype=torch.bfloat16)
        for start in range(0, 1024, step):
            part = qa.float()[:, start:start + step] @ qw.float()[:, start:start + step].t()
            acc = (acc.float() + part).to(torch.bfloat16)
        assert _beyond(_kernel_stand_in(qa, sa, qw, sw, acc=acc), emulated, bound) > 0, step


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
