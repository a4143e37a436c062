"""Read a local model directory into a `ModelSpec`.

The runtime never contacts a hub: everything comes from files in the directory
(config.json, tokenizer.json, and sentence-transformers' modules.json / pooling config when present).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from embedfleet.runtime.models.colbert import DENSE_MODULES, ColbertSpec, read_colbert

Pooling = Literal["mean", "cls", "last", "max", "splade", "token"]  # splade/token: sparse/multivector tasks
# sparse: SPLADE over an MLM head (one vocabulary-sized weight vector per input); multivector: one vector
# per token (ColBERT, models/colbert.py), scored by late interaction (MaxSim).
Task = Literal["embed", "rerank", "classify", "sparse", "multivector"]
TASKS: tuple[Task, ...] = ("embed", "rerank", "classify", "sparse", "multivector")
ENCODER_TASKS = frozenset({"embed", "sparse", "multivector"})  # served from the encoder's token states

DECODER_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}
SUPPORTED_MODULES = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
}
SPARSE_MODULES = {
    "sentence_transformers.sparse_encoder.models.MLMTransformer",
    "sentence_transformers.sparse_encoder.models.SpladePooling",
}
# Pooling and Normalize are ignored by the sparse and multi-vector tasks (they pool their own way).
TOKEN_TASK_MODULES = SUPPORTED_MODULES | SPARSE_MODULES | DENSE_MODULES


class ModelDirError(ValueError):
    """The directory cannot be served; the message says which file or field is wrong."""


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    name: str
    model_type: str
    architectures: tuple[str, ...]
    pooling: Pooling
    normalize: bool
    max_length: int
    hidden_size: int
    pad_token_id: int
    is_decoder: bool
    digest: str
    task: Task = "embed"
    labels: tuple[str, ...] = ()
    multi_label: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    vocab_size: int = 0
    colbert: ColbertSpec | None = None  # multivector models only

    @property
    def output_dim(self) -> int:
        """Width of what the model returns per input (per token for multivector); 0 for scorers."""
        if self.task == "sparse":
            return self.vocab_size
        if self.task == "multivector" and self.colbert is not None and self.colbert.projection is not None:
            return self.colbert.projection.out_features
        return self.hidden_size if self.task in ENCODER_TASKS else 0


def detect_task(architectures: tuple[str, ...], num_labels: int, module_types: tuple[str, ...] = ()) -> Task:
    """A sequence classifier with one output is a cross-encoder (reranker); more outputs classify.

    sentence-transformers' SparseEncoder modules mean SPLADE; a projection with no pooling module is
    PyLate's ColBERT layout. Without modules.json an MLM head (`*ForMaskedLM`) means SPLADE (naver's
    checkpoints ship that way); with one, the modules decide, because many dense sentence-transformers
    models (all-mpnet-base-v2) also declare `*ForMaskedLM`.
    """
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "rerank" if num_labels == 1 else "classify"
    kinds = set(module_types)
    if kinds & SPARSE_MODULES:
        return "sparse"
    if kinds & DENSE_MODULES and not any(k.endswith(".Pooling") for k in kinds):
        return "multivector"
    if not kinds and any(a.endswith("ForMaskedLM") for a in architectures):
        return "sparse"
    return "embed"


def task_fits(task: Task, detected: Task, architectures: tuple[str, ...]) -> str | None:
    """Why `--task` cannot serve a directory detected as `detected`, or None when it can."""
    scorer = detected in ("rerank", "classify")
    if task in ("rerank", "classify"):
        return None if scorer else "rerank and classify need a *ForSequenceClassification model"
    if scorer:
        return f"{task} needs a base model, not a *ForSequenceClassification one"
    if task == "sparse" and detected != "sparse" and not any(a.endswith("ForMaskedLM") for a in architectures):
        return "sparse (SPLADE) needs an MLM head: a *ForMaskedLM model"
    return None


def _check_sparse_pooling(path: Path, modules: list[dict]) -> None:
    """SPLADE as served here is max pooling of log(1 + relu(logits)); refuse a SparseEncoder configured
    otherwise rather than return different weights than sentence-transformers would."""
    for module in modules:
        if module.get("type", "").endswith(".SpladePooling"):
            cfg = _read_json(path / module["path"] / "config.json")
            strategy, activation = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
            if strategy != "max" or activation not in ("relu", None):
                raise ModelDirError(f"SpladePooling with pooling_strategy={strategy!r} and activation_function="
                                    f"{activation!r} is not supported (only max pooling of log(1 + relu))")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelDirError(f"{path.name} is missing from {path.parent}") from exc
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{path} is not valid JSON: {exc}") from exc


def _pooling_from_config(cfg: dict) -> Pooling:
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_max_tokens"):
        return "max"
    if cfg.get("pooling_mode_mean_tokens") or cfg.get("pooling_mode_mean_sqrt_len_tokens") is False:
        return "mean"
    raise ModelDirError(f"unsupported pooling configuration: {cfg}")


#: Files up to this size are hashed whole (configs, tokenizers, vocabularies, small weights).
WHOLE_FILE_BYTES = 4 << 20
#: Larger files (weights) are hashed in this many windows, evenly spaced from the first byte to the last.
SAMPLE_WINDOWS = 64
SAMPLE_BYTES = 64 << 10


def _sampled(p: Path, size: int) -> bytes:
    """SAMPLE_WINDOWS windows of SAMPLE_BYTES spread over the file, the first and the last included."""
    h = hashlib.sha256()
    step = (size - SAMPLE_BYTES) / (SAMPLE_WINDOWS - 1)
    with p.open("rb") as f:
        for i in range(SAMPLE_WINDOWS):
            f.seek(int(i * step))
            h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def directory_digest(path: Path) -> str:
    """A cheap identity for the weights: sha256 over file names, sizes and contents, large files sampled.

    It keys what must never be shared between different weights: the default vector space
    (``weights-<digest>``), the Redis vector cache and the int8/TensorRT-LLM engine builds. A fine-tune of
    a base model has the same file names, sizes and configs, so contents must count; hashing gigabytes
    at every start-up would be slow, so files above ``WHOLE_FILE_BYTES`` are read in 64 windows of 64 KiB
    (4 MiB a file) spread from the first byte to the last: weights that differ in more than a few scattered
    bytes differ here. The operator's cache verifies full contents where weights are downloaded. Hidden
    files and folders are left out.
    """
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        relative = p.relative_to(path)
        # Hidden entries are bookkeeping, not weights: the node cache's markers and its record of where and
        # how fast the weights came (different on every node), a hub download's .cache/ metadata.
        if p.is_file() and not any(part.startswith(".") for part in relative.parts):
            size = p.stat().st_size
            h.update(str(relative).encode())
            h.update(str(size).encode())
            h.update(p.read_bytes() if size <= WHOLE_FILE_BYTES else _sampled(p, size))
    return "sha256:" + h.hexdigest()


def load_spec(path: Path, served_name: str | None = None, task: Task | None = None) -> ModelSpec:
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    config = _read_json(path / "config.json")
    if not (path / "tokenizer.json").exists():
        raise ModelDirError(f"tokenizer.json is missing from {path} (a fast tokenizer file is required)")
    model_type = str(config.get("model_type", ""))
    is_decoder = model_type in DECODER_TYPES
    pooling: Pooling = "last" if is_decoder else "mean"
    normalize = is_decoder
    max_length = int(config.get("max_position_embeddings") or 512)
    if model_type in {"roberta", "xlm-roberta", "camembert", "mpnet"}:
        max_length -= 2  # positions are offset by padding_idx + 1

    architectures = tuple(config.get("architectures") or ())
    if "HF_ColBERT" in architectures:
        raise ModelDirError("Stanford ColBERT checkpoints (HF_ColBERT, the projection inside the encoder's "
                            "weights) are not supported; convert the model to PyLate's layout")
    id2label = config.get("id2label") or {}
    num_labels = int(config.get("num_labels") or len(id2label) or 2)
    modules_file = path / "modules.json"
    modules: list[dict] = _read_json(modules_file) if modules_file.exists() else []
    detected = detect_task(architectures, num_labels, tuple(m.get("type", "") for m in modules))
    if task is not None and (why := task_fits(task, detected, architectures)):
        raise ModelDirError(f"--task {task} does not fit {list(architectures)}: {why}")
    task = task or detected
    if modules:
        normalize = False
        allowed = SUPPORTED_MODULES if task == "embed" else TOKEN_TASK_MODULES
        for module in modules:
            kind = module.get("type", "")
            if kind not in allowed:
                hint = f" (this directory is a {detected} model: serve it with --task {detected})" \
                    if detected != task else ""
                raise ModelDirError(f"unsupported sentence-transformers module {kind!r} in modules.json{hint}")
            if task != "embed":
                continue
            if kind.endswith(".Pooling"):
                pooling = _pooling_from_config(_read_json(path / module["path"] / "config.json"))
            elif kind.endswith(".Normalize"):
                normalize = True
        st_cfg = path / "sentence_bert_config.json"
        if st_cfg.exists():
            max_length = min(max_length, int(_read_json(st_cfg).get("max_seq_length") or max_length))
    st_prompts = path / "config_sentence_transformers.json"
    st_config = _read_json(st_prompts) if st_prompts.exists() else {}
    prompts = {k: v for k, v in (st_config.get("prompts") or {}).items() if v}
    hidden_size = int(config.get("hidden_size") or config.get("d_model") or 0)
    colbert = None
    if task == "sparse":
        _check_sparse_pooling(path, modules)
        pooling = "splade"
    elif task == "multivector":
        colbert = read_colbert(path, modules, st_config, hidden_size, ModelDirError)
        pooling = "token"
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    pad = config.get("pad_token_id")
    if pad is None:
        pad = config.get("eos_token_id", 0)
        if isinstance(pad, list):
            pad = pad[0]
    return ModelSpec(
        path=path,
        name=served_name or path.name,
        model_type=model_type,
        architectures=architectures,
        pooling=pooling,
        normalize=normalize,
        max_length=max_length,
        hidden_size=hidden_size,
        pad_token_id=int(pad or 0),
        is_decoder=is_decoder,
        digest=directory_digest(path),
        task=task,
        labels=labels if task in ("rerank", "classify") else (),
        multi_label=config.get("problem_type") == "multi_label_classification",
        prompts=prompts,
        vocab_size=int(config.get("vocab_size") or 0),
        colbert=colbert,
    )

