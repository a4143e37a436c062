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

Pooling = Literal["mean", "cls", "last", "max"]
Task = Literal["embed", "rerank", "classify"]
TASKS: tuple[Task, ...] = ("embed", "rerank", "classify")

DECODER_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}
SUPPORTED_MODULES = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
}


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


def detect_task(architectures: tuple[str, ...], num_labels: int) -> Task:
    """A sequence classifier with one output is a cross-encoder (reranker); more outputs classify."""
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "rerank" if num_labels == 1 else "classify"
    return "embed"


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


def directory_digest(path: Path) -> str:
    """A cheap identity for the weights: sha256 over file names, sizes and config contents.

    Hashing gigabytes at every start-up would be slow; the operator's cache verifies full content.
    """
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(str(p.stat().st_size).encode())
            if p.suffix == ".json" and p.stat().st_size < 1_000_000:
                h.update(p.read_bytes())
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
    if model_type in {"roberta", "xlm-roberta", "camembert"}:
        max_length -= 2  # positions are offset by padding_idx + 1

    modules_file = path / "modules.json"
    if modules_file.exists():
        modules = json.loads(modules_file.read_text())
        normalize = False
        for module in modules:
            kind = module.get("type", "")
            if kind not in SUPPORTED_MODULES:
                raise ModelDirError(f"unsupported sentence-transformers module {kind!r} in modules.json")
            if kind.endswith(".Pooling"):
                pooling = _pooling_from_config(_read_json(path / module["path"] / "config.json"))
            elif kind.endswith(".Normalize"):
                normalize = True
        st_cfg = path / "sentence_bert_config.json"
        if st_cfg.exists():
            max_length = min(max_length, int(_read_json(st_cfg).get("max_seq_length") or max_length))
    prompts: dict[str, str] = {}
    st_prompts = path / "config_sentence_transformers.json"
    if st_prompts.exists():
        prompts = {k: v for k, v in (_read_json(st_prompts).get("prompts") or {}).items() if v}

    architectures = tuple(config.get("architectures") or ())
    id2label = config.get("id2label") or {}
    num_labels = int(config.get("num_labels") or len(id2label) or 2)
    detected = detect_task(architectures, num_labels)
    if task is not None and (task == "embed") != (detected == "embed"):
        raise ModelDirError(f"--task {task} does not fit {list(architectures)}: rerank and classify need a "
                            "*ForSequenceClassification model; embed needs a base model")
    task = task or detected
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
        hidden_size=int(config.get("hidden_size") or config.get("d_model") or 0),
        pad_token_id=int(pad or 0),
        is_decoder=is_decoder,
        digest=directory_digest(path),
        task=task,
        labels=labels if task != "embed" else (),
        multi_label=config.get("problem_type") == "multi_label_classification",
        prompts=prompts,
    )

