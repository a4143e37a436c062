"""FP8 (float8 e4m3) linear layers: weight quantisation, dynamic activation scaling, scaled matmul.

Only the transformer layers' `nn.Linear`s are quantised: they hold almost all the FLOPs, while
attention softmax, norms, embeddings and pooling are cheap and precision-sensitive, so they stay
bf16. Weights get one scale per output channel (a row of W), fixed at load time; activations get
one scale per token (row) or per tensor, computed on every call, because activation ranges vary
per input. On Hopper and newer the product runs in `torch._scaled_mm`; everywhere else an fp32
emulation computes the same products (e4m3 values are exact in fp32; the scales are applied after
the accumulation, as the hardware does), so the CPU test suite checks the numerics the GPU runs up
to the tensor cores' accumulation precision (about 14 bits inside an instruction on Hopper) and bf16
rounding: tests/gpu/test_on_gpu.py holds the kernel to that bound. Serving also lets the kernel
accumulate fast and add the bias in its epilogue; the quality gate judges what is served.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale (its values quantise to 0)

ActScaling = Literal["token", "tensor"]


def absmax_scales(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The scale mapping the largest magnitude (per row along `dim`, or overall) onto e4m3's 448.

    fp32 always: a bf16 scale would add its own rounding error to every value.
    """
    a = x.detach().abs().float()
    amax = a.amax() if dim is None else a.amax(dim=dim, keepdim=True)
    return (amax / E4M3_MAX).clamp(min=MIN_SCALE)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest, saturating at +-448: no inf can appear)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [out, in], fp32 scale [out]): one scale per output channel."""
    scale = absmax_scales(weight, dim=1)
    return quantize(weight, scale), scale.squeeze(1).contiguous()


def quantize_activation(x: torch.Tensor, scaling: ActScaling = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x [m, k], fp32 scale [m, 1]). A per-tensor scale is broadcast to [m, 1] so both
    modes use the same row-wise kernel."""
    scale = absmax_scales(x, dim=1 if scaling == "token" else None)
    if scaling == "tensor":
        scale = scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return quantize(x, scale), scale


def scaled_mm_emulated(qa: torch.Tensor, scale_a: torch.Tensor, qw: torch.Tensor, scale_w: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """What `torch._scaled_mm(qa, qw.t(), scale_a, scale_w[None])` computes, in fp32.

    qa [m, k] e4m3, scale_a [m, 1]; qw [n, k] e4m3, scale_w [n].
    """
    acc = qa.float() @ qw.float().t()
    return (acc * scale_a * scale_w.unsqueeze(0)).to(out_dtype)


def scaled_mm_supported(device: torch.device) -> bool:
    """Row-wise scaled FP8 GEMMs need Hopper (sm90) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def scaled_mm_cuda(qa: torch.Tensor, scale_a: torch.Tensor, qw: torch.Tensor, scale_w: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None, fast_accum: bool = False) -> torch.Tensor:
    """cuBLASLt FP8 GEMM; `qw.t()` of a row-major [n, k] tensor is the column-major operand it wants.
    Row-wise scaling produces bf16, cast afterwards if the model runs in another dtype. `bias` (bf16) is
    added in the GEMM's epilogue instead of by a kernel of its own; `fast_accum` lets the tensor cores keep
    partial sums in their own precision between promotions (faster; a little less exact, which the
    quality gate measures: the serving path uses it, the test of the kernel against the emulation not)."""
    out = torch._scaled_mm(qa, qw.t(), scale_a=scale_a, scale_b=scale_w.unsqueeze(0), bias=bias,
                           out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


class Fp8Linear(nn.Module):
    """Drop-in for `nn.Linear` holding an e4m3 weight and its per-output-channel scales."""

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 act_scaling: ActScaling = "token") -> None:
        super().__init__()
        self.out_features, self.in_features = weight_q.shape
        self.act_scaling: ActScaling = act_scaling
        self.register_buffer("weight", weight_q)
        self.register_buffer("weight_scale", weight_scale.float())
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        # cuBLASLt's FP8 kernels need both GEMM dims of the weight to be multiples of 16; decided here, once,
        # from the weight's device, so the forward holds no device query (torch.compile traces it whole)
        self.kernel_shape_ok = self.in_features % 16 == 0 and self.out_features % 16 == 0
        self._use_kernel = self.kernel_shape_ok and scaled_mm_supported(weight_q.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_scaling: ActScaling = "token") -> Fp8Linear:
        q, scale = quantize_weight(linear.weight.data)
        return cls(q, scale, linear.bias, act_scaling)

    def _apply(self, fn, recurse=True):  # .to(device) moves the weight: decide the kernel again
        out = super()._apply(fn, recurse)
        self._use_kernel = self.kernel_shape_ok and scaled_mm_supported(self.weight.device)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, act_scaling={self.act_scaling}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        qa, scale_a = quantize_activation(flat, self.act_scaling)
        if self._use_kernel:
            bias = self.bias.to(torch.bfloat16) if self.bias is not None else None
            y = scaled_mm_cuda(qa, scale_a, self.weight, self.weight_scale, x.dtype, bias=bias, fast_accum=True)
        else:
            y = scaled_mm_emulated(qa, scale_a, self.weight, self.weight_scale, x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def transformer_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The stack of transformer blocks: the ModuleList holding the most parameters.

    Works for BERT (`encoder.layer`), XLM-R, Llama/Qwen2/Mistral (`layers`) without a per-family
    table, and leaves heads (pooler, classifier, score) outside it untouched.
    """
    best: tuple[str, nn.ModuleList] | None = None
    best_size = -1
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = (name, module), size
    if best is None:
        raise ValueError(f"{type(model).__name__} has no stack of transformer layers (nn.ModuleList)")
    return best


def quantize_model(model: nn.Module, act_scaling: ActScaling = "token") -> dict[str, nn.Linear]:
    """Replace every nn.Linear inside the transformer layers with an Fp8Linear, in place.

    Returns the replaced modules by qualified name, so a caller that rejects FP8 after measuring
    it (the quality gate) can put them back with `restore_model` without reloading weights.
    """
    prefix, layers = transformer_layers(model)
    originals: dict[str, nn.Linear] = {}
    targets = [(name, m) for name, m in layers.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = layers.get_submodule(parent_name) if parent_name else layers
        setattr(parent, child, Fp8Linear.from_linear(linear, act_scaling))
        originals[f"{prefix}.{name}" if prefix else name] = linear
    log.info("fp8: quantised %d linear layers under %r (activation scaling per %s)", len(originals),
             prefix, act_scaling)
    return originals


def restore_model(model: nn.Module, originals: dict[str, nn.Linear]) -> None:
    for name, linear in originals.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, linear)
