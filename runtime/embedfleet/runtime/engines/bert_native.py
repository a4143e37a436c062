"""BERT encoders built from torch modules alone: the CPU start-up path of the most common embedders.

Why: importing transformers' model classes (its lazy-module scan, and torch._dynamo and torch.distributed
pulled in by its loading code) was most of a CPU start's time, for a model whose forward pass is a dozen
torch calls (docs/performance.md, "Start-up", measured by bench/serve_start.py). TEI does the same for its
models (its own implementations, no transformers).

What it covers: `model_type == "bert"` checkpoints with absolute positions and a GELU/ReLU activation in
one `model.safetensors`, as an encoder (embed) or `BertForSequenceClassification` (rerank, classify), in
float32 or bfloat16 on CPU. Everything else (other families, FP8, int8 builds, CUDA's packed path, .bin
weights) keeps transformers (engines/torch_engine.py falls back and logs why).

The modules and their attribute names mirror transformers' (`embeddings.word_embeddings`,
`encoder.layer[i].attention.self.query`, ...), so the checkpoint loads by name with no mapping, the
layer stack is found by `repeated_layers` (preemption between layers), engines/packed.py can run them, and
the maths is the same: the tests compare outputs with transformers' on the same weights.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

from embedfleet.runtime.models.spec import ModelSpec

log = logging.getLogger(__name__)

ACTIVATIONS = {
    "gelu": lambda x: functional.gelu(x),
    "gelu_new": lambda x: functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: functional.gelu(x, approximate="tanh"),
    "relu": functional.relu,
}
WEIGHTS = "model.safetensors"
LAYER_KEY = re.compile(r"(?:bert\.)?encoder\.layer\.(\d+)\.")


#: BertShape's sizes: each at least 1 (a zero of heads divides by zero; a negative size fails deep in torch)
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
         "max_position_embeddings", "type_vocab_size", "num_labels")


@dataclass(frozen=True)
class BertShape:
    """The config.json fields the forward pass reads."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    num_labels: int
    pad_token_id: int | None

    @classmethod
    def from_config(cls, config: dict) -> BertShape:
        """The shape config.json describes; ValueError (the engine falls back to transformers, which
        judges the file itself) where a size is under 1 or the norm's epsilon is not in (0, 1)."""
        id2label = config.get("id2label") or {}
        pad = config.get("pad_token_id")
        shape = cls(vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
                    num_hidden_layers=int(config["num_hidden_layers"]),
                    num_attention_heads=int(config["num_attention_heads"]),
                    intermediate_size=int(config["intermediate_size"]),
                    hidden_act=str(config.get("hidden_act", "gelu")),
                    layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                    max_position_embeddings=int(config.get("max_position_embeddings", 512)),
                    type_vocab_size=int(config.get("type_vocab_size", 2)),
                    num_labels=int(config.get("num_labels") or len(id2label) or 2),
                    pad_token_id=None if pad is None else int(pad))
        small = [name for name in SIZES if getattr(shape, name) < 1]
        if small:
            raise ValueError(f"{', '.join(small)} under 1")
        if not 0.0 < shape.layer_norm_eps < 1.0:  # NaN fails this too
            raise ValueError(f"layer_norm_eps {shape.layer_norm_eps} not in (0, 1)")
        return shape


def unsupported(spec: ModelSpec, device: str, dtype: torch.dtype) -> str | None:
    """Why this model keeps transformers here (None: the native modules serve it)."""
    return check(spec, device, dtype)[1]


def check(spec: ModelSpec, device: str, dtype: torch.dtype) -> tuple[BertShape | None, str | None]:
    """The model's shape where the native modules serve it, else why not; the shape goes on to `load`
    (config.json is read once)."""
    if device != "cpu":
        return None, f"device {device} (the native modules serve CPU)"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"dtype {dtype}"
    if spec.model_type != "bert":
        return None, f"model type {spec.model_type!r}"
    if spec.task not in ("embed", "rerank", "classify"):
        return None, f"task {spec.task}"
    if not (spec.path / WEIGHTS).is_file():
        return None, f"no {WEIGHTS}"
    try:
        config = json.loads((spec.path / "config.json").read_text())
        shape = BertShape.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"config.json: {type(exc).__name__}: {exc}"
    if str(config.get("position_embedding_type", "absolute")) != "absolute":
        return None, "relative position embeddings"
    if shape.hidden_act not in ACTIVATIONS:
        return None, f"activation {shape.hidden_act!r}"
    if shape.hidden_size % shape.num_attention_heads:
        return None, "hidden size not a multiple of the heads"
    if config.get("is_decoder") or config.get("add_cross_attention"):
        return None, "a decoder configuration"
    architectures = tuple(config.get("architectures") or ())
    if spec.task != "embed" and architectures != ("BertForSequenceClassification",):
        return None, f"architectures {architectures} for {spec.task}"
    return shape, None


class Embeddings(nn.Module):
    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(s.vocab_size, s.hidden_size)
        self.position_embeddings = nn.Embedding(s.max_position_embeddings, s.hidden_size)
        self.token_type_embeddings = nn.Embedding(s.type_vocab_size, s.hidden_size)
        self.LayerNorm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids)
        x = x + (self.token_type_embeddings(token_type_ids) if token_type_ids is not None
                 else self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.position_embeddings(positions))


class SelfAttention(nn.Module):
    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.num_attention_heads = s.num_attention_heads  # transformers' names: engines/packed.py reads them
        self.attention_head_size = s.hidden_size // s.num_attention_heads
        self.query = nn.Linear(s.hidden_size, s.hidden_size)
        self.key = nn.Linear(s.hidden_size, s.hidden_size)
        self.value = nn.Linear(s.hidden_size, s.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, h = x.shape
        split = (b, t, self.num_attention_heads, self.attention_head_size)
        q, k, v = (m(x).view(split).transpose(1, 2) for m in (self.query, self.key, self.value))
        out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, h)


class DenseNorm(nn.Module):
    """dense, then LayerNorm over the residual: transformers' BertSelfOutput and BertOutput."""

    def __init__(self, into: int, s: BertShape) -> None:
        super().__init__()
        self.dense = nn.Linear(into, s.hidden_size)
        self.LayerNorm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.add_module("self", SelfAttention(s))  # transformers' name, so the checkpoint loads as it is
        self.output = DenseNorm(s.hidden_size, s)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self._modules["self"](x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.dense = nn.Linear(s.hidden_size, s.intermediate_size)
        self.intermediate_act_fn = ACTIVATIONS[s.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class Layer(nn.Module):
    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.attention = Attention(s)
        self.intermediate = Intermediate(s)
        self.output = DenseNorm(s.intermediate_size, s)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(s) for _ in range(s.num_hidden_layers))


class Pooler(nn.Module):
    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.dense = nn.Linear(s.hidden_size, s.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertEncoder(nn.Module):
    """transformers' BertModel forward for inference: `.last_hidden_state` of the token states."""

    def __init__(self, s: BertShape, pooler: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=s.pad_token_id, position_embedding_type="absolute")
        self.embeddings = Embeddings(s)
        self.encoder = Encoder(s)
        self.pooler = Pooler(s) if pooler else None

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        # a key mask over every query ([batch, 1, 1, keys], True = attend); none where no row is padded
        mask = None if attention_mask is None or bool(attention_mask.all()) else \
            attention_mask[:, None, None, :].bool()
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=self.hidden(input_ids, attention_mask, token_type_ids))


class BertClassifier(nn.Module):
    """transformers' BertForSequenceClassification for inference: `.logits` from the pooled [CLS] state."""

    def __init__(self, s: BertShape) -> None:
        super().__init__()
        self.bert = BertEncoder(s, pooler=True)
        self.config = self.bert.config
        self.classifier = nn.Linear(s.hidden_size, s.num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> SimpleNamespace:
        hidden = self.bert.hidden(input_ids, attention_mask, token_type_ids)
        assert self.bert.pooler is not None
        return SimpleNamespace(logits=self.classifier(self.bert.pooler(hidden)))


class _SkipInit(TorchFunctionMode):
    """Builds modules without initialising their parameters (torch.nn.init's functions return the tensor
    as it is). Every parameter is replaced from the weights file at once, so the random init is wasted;
    on the meta device it also reaches torch's reference implementations, whose first call imports
    torch._dynamo: about 2 s of a server's start on two cores, for nothing. A mode, so it holds for this
    thread alone (another thread building a model to use as initialised is unaffected)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


class NativeLoadError(ValueError):
    """The checkpoint's tensors do not fit the native modules (the engine falls back to transformers)."""


def load(spec: ModelSpec, dtype: torch.dtype, shape: BertShape | None = None) -> nn.Module:
    """The model from `model.safetensors`, every parameter from the file (a missing or misshapen tensor
    raises NativeLoadError rather than serving random weights). `shape`: `check`'s, else config.json's."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if shape is None:
        shape = BertShape.from_config(json.loads((spec.path / "config.json").read_text()))
    with safe_open(str(Path(spec.path) / WEIGHTS), "pt") as f:  # the header alone: names, no tensor data
        stored = {int(m.group(1)) for k in f.keys() if (m := LAYER_KEY.match(k))}
    # checked before a module is built (a config's count is unbounded), by length first (so is a set of it)
    if len(stored) != shape.num_hidden_layers or stored != set(range(len(stored))):
        raise NativeLoadError(f"config.json says {shape.num_hidden_layers} layers; {WEIGHTS} holds "
                              f"{len(stored)} (numbered {min(stored, default=0)}..{max(stored, default=-1)})")
    # built on the meta device: no memory is taken until the file's tensors are checked and assigned, so a
    # config.json that names enormous sizes fails on the shapes below instead of allocating them
    with torch.device("meta"), _SkipInit():
        model: nn.Module = BertEncoder(shape) if spec.task == "embed" else BertClassifier(shape)
    tensors = load_file(str(Path(spec.path) / WEIGHTS))
    if spec.task == "embed":  # a BertForX checkpoint served as an encoder keeps its weights under `bert.`
        prefixed = any(k.startswith("bert.") for k in tensors) and not any(k.startswith("embeddings.") for k in tensors)
        tensors = {k.removeprefix("bert."): v for k, v in tensors.items()} if prefixed else tensors
    elif not any(k.startswith("bert.") for k in tensors):
        tensors = {f"bert.{k}" if not k.startswith("classifier.") else k: v for k, v in tensors.items()}
    wanted = model.state_dict()
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise NativeLoadError(f"{WEIGHTS} lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    for name, param in wanted.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise NativeLoadError(f"{name} is {tuple(tensors[name].shape)} in {WEIGHTS}, the config says "
                                  f"{tuple(param.shape)}")
        if not tensors[name].is_floating_point():
            raise NativeLoadError(f"{name} is {tensors[name].dtype} in {WEIGHTS}, not a floating-point tensor")
    model.load_state_dict({name: tensors[name] for name in wanted}, strict=True, assign=True)
    return model.to(dtype).eval()
