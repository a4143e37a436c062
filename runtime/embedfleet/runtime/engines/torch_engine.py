"""PyTorch engine: transformers' model classes, SDPA attention, inference mode.

Runs on one dedicated thread (the batch manager's), so torch's intra-op pool owns the cores.
On CUDA (engines/cuda.py) batches are staged through pinned memory and padded on the device, the
batch token budget is checked against free GPU memory at start-up, and shapes can be bucketed
for CUDA graphs. `dtype="fp8"` loads bf16, then keeps FP8 linears (engines/fp8.py) only if the
quality gate (engines/quality_gate.py) accepts them; on CPU the FP8 maths is emulated in fp32.
bf16 (and fp8's bf16 base) on CPU is probed first (engines/cpu_isa.py): where it crashes the CPU,
oneDNN's ISA is capped or the engine serves float32.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedfleet.runtime.engines.base import Capabilities, pad_batch
from embedfleet.runtime.engines.cpu_isa import ensure_cpu_bf16
from embedfleet.runtime.engines.packed import GRAPH_TOKENS, PackedEncoder, packed_unsupported
from embedfleet.runtime.engines.quality_gate import DEFAULT_MIN_COSINE, GateResult
from embedfleet.runtime.models.colbert import Projection
from embedfleet.runtime.models.spec import ENCODER_TASKS, ModelSpec

log = logging.getLogger(__name__)
MAX_GRAPHS = 128  # CUDA graph shapes captured at most (each costs start-up time and a little memory)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINE_DTYPES = (*DTYPES, "fp8")  # fp8: bf16 model with FP8 linears in the transformer layers


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


def splade_pool(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SPLADE: max over tokens of log(1 + relu(logits)), padding excluded; one vocabulary-sized row per input.

    log1p(relu(x)) never decreases with x, so the max is taken over the raw logits first and the
    activation applied to (batch x vocab) only, not to (batch x tokens x vocab): a masked token is set to
    0 in place, which is log1p(relu(0)) = 0, exactly what masking after the activation gives.
    """
    logits.masked_fill_(mask.unsqueeze(-1) == 0, 0.0)
    return torch.log1p(torch.relu(logits.amax(dim=1).float()))


def load_projection(projection: Projection, device: torch.device) -> torch.nn.Linear:
    """The ColBERT linear layer (models/colbert.py), run in float32 after the encoder."""
    if projection.path.suffix == ".safetensors":
        from safetensors.torch import load_file

        weights = load_file(str(projection.path))
    else:
        weights = torch.load(projection.path, map_location="cpu", weights_only=True)
    weight = next((v for k, v in weights.items() if k.endswith("linear.weight")), None)
    if weight is None or tuple(weight.shape) != (projection.out_features, projection.in_features):
        raise EngineError(f"{projection.path} has no linear.weight of shape "
                          f"({projection.out_features}, {projection.in_features})")
    layer = torch.nn.Linear(projection.in_features, projection.out_features, bias=projection.bias)
    layer.weight.data.copy_(weight.float())
    if projection.bias:
        bias = next((v for k, v in weights.items() if k.endswith("linear.bias")), None)
        if bias is None:
            raise EngineError(f"{projection.path} has no linear.bias though its config says bias=true")
        layer.bias.data.copy_(bias.float())
    return layer.to(device).eval()


def repeated_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of transformer blocks: its longest ModuleList of two or more modules of one class
    (BERT's encoder.layer, XLM-R's, ModernBERT's layers, a decoder's layers); None if it has none."""
    best = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and \
                len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best)):
            best = module
    return best


def _load(loader: Any, path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The model with PyTorch's fused attention (SDPA) where transformers has it for the architecture, else
    its eager attention: MPNet (all-mpnet-base-v2) has no SDPA path in transformers and would not load."""
    try:
        return loader.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa", local_files_only=True)
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc) and "sdpa" not in str(exc).lower():
            raise
        log.info("%s has no SDPA attention in transformers; loading its eager attention", path.name)
        return loader.from_pretrained(str(path), dtype=dtype, attn_implementation="eager", local_files_only=True)


def _loader(task: str) -> Any:
    """transformers' Auto class for a task (imported here: it is the slow part of a start)."""
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    return {"embed": AutoModel, "multivector": AutoModel, "sparse": AutoModelForMaskedLM}.get(
        task, AutoModelForSequenceClassification)


class TorchEngine:
    int8_gate: GateResult | None = None  # set by engines/int8_cpu.py when int8 was refused and float32 serves

    def __init__(self, spec: ModelSpec, device: str = "cpu", dtype: str = "float32",
                 num_threads: int = 0, *, max_batch_tokens: int | None = None,
                 fp8_min_cosine: float = DEFAULT_MIN_COSINE, fp8_strict: bool = False,
                 fp8_activation_scaling: str = "token", cuda_graphs: bool | None = False,
                 max_batch_requests: int = 32, packed: bool = True, compile: bool = False,
                 native: bool = True) -> None:
        if dtype not in ENGINE_DTYPES:
            raise EngineError(f"dtype {dtype!r} is not supported by the torch engine on {device}")
        if device == "cuda" and not torch.cuda.is_available():
            raise EngineError("device 'cuda' requested but torch sees no CUDA device")
        if dtype == "float16" and device == "cpu":
            raise EngineError("float16 on CPU is slow and inaccurate; use bfloat16 or float32")
        if dtype == "fp8" and spec.task in ("sparse", "multivector"):
            raise EngineError(f"fp8 is not supported for {spec.task} models (its quality gate compares pooled "
                              "embeddings); use bfloat16")
        if device == "cpu" and dtype in ("bfloat16", "fp8"):
            dtype = self._cpu_bf16_or_float32(dtype)
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.spec = spec
        self.device = torch.device(device)
        base_dtype = "bfloat16" if dtype == "fp8" else dtype
        self.dtype = DTYPES[base_dtype]
        self.effective_dtype = base_dtype  # what actually runs; "fp8" once the gate accepts it
        self.fp8_gate: GateResult | None = None
        model = self._native(spec, device, native and dtype != "fp8")
        if model is None:
            model = _load(_loader(spec.task), spec.path, self.dtype).to(self.device).eval()
        self.model = model
        if spec.task not in ENCODER_TASKS and self.model.config.pad_token_id is None:
            # decoder classifiers find each row's last token through the pad id
            self.model.config.pad_token_id = spec.pad_token_id
        self.capabilities = Capabilities(
            tasks=(spec.task,), pooling=spec.pooling, max_tokens=spec.max_length,
            dtypes=ENGINE_DTYPES, device=device, dim=spec.output_dim or len(spec.labels))
        colbert = spec.colbert
        self.projection = load_projection(colbert.projection, self.device) \
            if colbert is not None and colbert.projection is not None else None
        self._stage = None
        self._forward = self.model
        self.graph_shapes: list[tuple[int, int]] = []  # captured at warm-up when cuda_graphs is on
        self.max_batch_requests = max_batch_requests
        # engines/packed.py on CUDA, engines/packed_cpu.py on CPU (the native BERT modules): BERT-family embedders
        self.packed: PackedEncoder | None = None
        self.packed_reason = "--no-packed"
        if packed:
            self._setup_packed(compile)
        if dtype == "fp8":
            self._enable_fp8(fp8_min_cosine, fp8_strict, fp8_activation_scaling)
        self._packed_graphs = bool(self.device.type == "cuda" and self.packed is not None and cuda_graphs is not False)
        if self.device.type == "cuda":
            self._setup_cuda(max_batch_tokens, bool(cuda_graphs) and self.packed is None)

    def _native(self, spec: ModelSpec, device: str, allowed: bool) -> torch.nn.Module | None:
        """The model from engines/bert_native.py where it serves this checkpoint, else None (transformers
        loads it). `implementation` says which, and a fallback is logged with its reason."""
        from embedfleet.runtime.engines import bert_native

        self.implementation = "transformers"
        if not allowed:
            return None
        shape, why = bert_native.check(spec, device, self.dtype)
        if shape is not None:
            try:
                model = bert_native.load(spec, self.dtype, shape)
            except bert_native.NativeLoadError as exc:
                why = str(exc)
            else:
                self.implementation = "native"
                return model.to(self.device)
        if spec.model_type == "bert":
            log.info("%s loads through transformers: %s", spec.name, why)
        return None

    def _setup_packed(self, compile: bool) -> None:
        why = packed_unsupported(self.model, self.spec.model_type, self.spec.task, self.device, self.dtype)
        if why is None and self.device.type == "cpu" and self.implementation != "native":
            why = "on CPU only the native BERT modules run packed (engines/bert_native.py)"
        if why is not None:
            self.packed_reason = why
            log.info("packed sequences off for %s: %s (padded batches)", self.spec.name, why)
            return
        self.packed_reason = ""
        if self.device.type == "cpu":
            from embedfleet.runtime.engines.packed_cpu import CpuPackedEncoder

            self.packed = CpuPackedEncoder(self.model, self.spec.model_type, self.spec.pooling)
            log.info("packed sequences on for %s (attention by length group)", self.spec.name)
            return
        self.packed = PackedEncoder(self.model, self.spec.model_type, self.spec.pooling, self.device, compile=compile)
        log.info("packed sequences on for %s (variable-length FlashAttention%s)", self.spec.name,
                 ", compiled layers" if compile else "")

    def free_memory(self) -> int:
        """Free bytes on the engine's GPU now (the weights loaded), for sizing the batch budget."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(self.device)[0])

    @staticmethod
    def _cpu_bf16_or_float32(dtype: str) -> str:
        """bf16 on CPU only where a child process ran it without crashing (engines/cpu_isa.py);
        else float32, with the probe's WARNING saying why. Runs before this engine's first matmul."""
        isa = ensure_cpu_bf16()
        if not isa.fp32:
            raise EngineError(isa.message)
        return dtype if isa.bf16 else "float32"

    def _enable_fp8(self, min_cosine: float, strict: bool, act_scaling: str) -> None:
        from embedfleet.runtime.engines.fp8 import scaled_mm_supported
        from embedfleet.runtime.engines.quality_gate import gate_fp8

        if not scaled_mm_supported(self.device):
            where = "on CPU" if self.device.type == "cpu" else f"on {torch.cuda.get_device_name(self.device)}"
            log.warning("fp8 %s: no FP8 tensor cores (Hopper or newer), so FP8 GEMMs run as an fp32 "
                        "emulation: the same numbers, slower than bfloat16", where)
        self.fp8_gate = gate_fp8(self, self.spec, min_cosine, strict, act_scaling)  # type: ignore[arg-type]
        self.effective_dtype = "fp8" if self.fp8_gate.passed else "bfloat16"

    def _setup_cuda(self, max_batch_tokens: int | None, cuda_graphs: bool) -> None:
        from embedfleet.runtime.engines.cuda import DeviceStager, check_cuda_memory

        bucket_to = (self.max_batch_requests, self.spec.max_length) if cuda_graphs else None
        self._stage = DeviceStager(self.device, self.spec.pad_token_id, bucket_to)
        if max_batch_tokens:
            # bucketing rounds both dimensions up to a power of two: up to 4x the padded tokens
            check_cuda_memory(self.model.config, max_batch_tokens * (4 if cuda_graphs else 1),
                              self.effective_dtype, self.device)
        if cuda_graphs:
            from embedfleet.runtime.engines.cuda import served_shapes

            self.graph_shapes = served_shapes(*bucket_to, max_batch_tokens or self.spec.max_length)
            if len(self.graph_shapes) > MAX_GRAPHS:
                raise EngineError(f"--cuda-graphs would capture {len(self.graph_shapes)} shapes (more than "
                                  f"{MAX_GRAPHS}); lower --max-batch-requests or --max-batch-tokens, or serve "
                                  "without it")
            # every served shape is compiled once at warm-up: the recompile limit must not send any to eager
            import torch._dynamo

            limit = len(self.graph_shapes) + 4
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
            # reduce-overhead = CUDA graphs per static shape; bucketing keeps the shapes few
            self._forward = torch.compile(self.model, mode="reduce-overhead", dynamic=False)
            log.info("cuda graphs on: %d shapes (rows <= %d, width <= %d), captured at warm-up",
                     len(self.graph_shapes), *bucket_to)

    @property
    def runs_packed(self) -> bool:
        """Whether `embed` runs packed sequences: a batch then costs its real tokens, and the batch planner
        fills batches in real tokens instead of weighing padding (core/batching.py)."""
        return self.packed is not None and self.spec.task == "embed"

    @property
    def packs_by_length(self) -> bool:
        """Whether the planner should batch packed urgent inputs of similar lengths (CPU: a batch's time is its
        tokens, so a query batched with passages waits for them; core/batching.py `nearest_that_fit`)."""
        return self.runs_packed and self.device.type == "cpu"

    @property
    def preemptible(self) -> bool:
        """Whether `between_layers` can be served: on CPU, where a layer runs when Python calls it (on CUDA
        the host only queues kernels, so a pause there would not free the device) and the model is not
        compiled (a hook would break the graph)."""
        return self.device.type == "cpu" and self._forward is self.model and repeated_layers(self.model) is not None

    def between_layers(self, callback) -> int:
        """Call `callback()` on this thread before each transformer layer but the first, during every
        forward pass: the batch manager runs a query's batch there while a long bulk batch waits, its
        activations kept (core/batcher.py, preemption). One Python call per layer when there is nothing
        to run. Returns the number of stretches a forward pass is cut into (its layers)."""
        layers = repeated_layers(self.model)
        if layers is None or not self.preemptible:
            raise EngineError("this engine cannot pause between layers (CUDA, compiled, or no layer stack)")

        def pause(_module, _args) -> None:
            callback()

        for layer in list(layers)[1:]:
            layer.register_forward_pre_hook(pause)
        if self.packed is not None:  # the packed CPU path calls its layers' parts, not the layer modules
            self.packed.pause = callback  # type: ignore[attr-defined]
        return len(layers)

    def warmup(self) -> None:
        """One small batch; with CUDA graphs, one batch of every served shape, so live traffic never
        compiles (the count and time are logged)."""
        run = self.runner()
        token = self.spec.pad_token_id + 1
        if self.packed is not None:
            run([[token] * 8, [token] * 3])
            if self._packed_graphs:
                started = time.perf_counter()
                with torch.inference_mode():
                    n = self.packed.capture_graphs(max(GRAPH_TOKENS))
                self.graph_shapes = list(self.packed._graphs)
                log.info("captured %d CUDA graphs of small batches in %.1fs", n, time.perf_counter() - started)
            return
        if not self.graph_shapes:
            run([[token] * 8, [token] * 3])
            return
        started = time.perf_counter()
        for rows, width in self.graph_shapes:
            run([[token] * width] * rows)
        log.info("captured %d CUDA graph shapes in %.1fs", len(self.graph_shapes), time.perf_counter() - started)

    def runner(self):
        """The method that serves this model's task (what the batch manager calls)."""
        return {"embed": self.embed, "sparse": self.embed_sparse, "multivector": self.embed_tokens}.get(
            self.spec.task, self.classify)

    def _inputs(self, batch: list) -> dict[str, torch.Tensor]:
        if self._stage is not None:
            return self._stage(batch)
        padded = pad_batch(batch, self.spec.pad_token_id)
        inputs = {"input_ids": torch.from_numpy(padded.ids).to(self.device, non_blocking=True),
                  "attention_mask": torch.from_numpy(padded.mask).to(self.device, non_blocking=True)}
        if padded.type_ids is not None:
            inputs["token_type_ids"] = torch.from_numpy(padded.type_ids).to(self.device, non_blocking=True)
        return inputs

    @torch.inference_mode()
    def embed(self, batch: list) -> np.ndarray:
        if self.packed is not None:
            return self.packed.embed(batch).cpu().numpy()
        inputs = self._inputs(batch)
        hidden = self._forward(**inputs).last_hidden_state
        return pool(hidden, inputs["attention_mask"], self.spec.pooling)[: len(batch)].cpu().numpy()

    @torch.inference_mode()
    def classify(self, batch: list) -> np.ndarray:
        return self._forward(**self._inputs(batch)).logits[: len(batch)].float().cpu().numpy()

    @torch.inference_mode()
    def embed_sparse(self, batch: list) -> np.ndarray:
        inputs = self._inputs(batch)
        logits = self._forward(**inputs).logits[: len(batch)]
        return splade_pool(logits, inputs["attention_mask"][: len(batch)]).cpu().numpy()

    @torch.inference_mode()
    def embed_tokens(self, batch: list) -> list[np.ndarray]:
        """Unit-length per-token vectors (after the ColBERT projection, if any): one (tokens x dim) array
        per input, ragged. An input's `attended` (ColBERT query expansion, core/multivector.py) is how many
        of its tokens the others attend to; the [MASK] tokens after it are encoded but not attended."""
        inputs = self._inputs(batch)
        mask = inputs["attention_mask"]
        for row, x in enumerate(batch):
            attended = getattr(x, "attended", None)
            if attended is not None and attended < len(x):
                mask[row, attended:] = 0
        hidden = self._forward(**inputs).last_hidden_state[: len(batch)].float()
        if self.projection is not None:
            hidden = self.projection(hidden)
        states = torch.nn.functional.normalize(hidden, dim=-1).cpu().numpy()
        return [states[row, : len(x)] for row, x in enumerate(batch)]
