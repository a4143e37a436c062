"""The ColBERT (late-interaction) layout of a model directory, as PyLate saves it.

Supported: modules.json = a sentence-transformers Transformer followed by one linear projection module,
`pylate.models.Dense.Dense` or `sentence_transformers.models.Dense`, whose folder holds `config.json`
(in_features, out_features, bias, activation_function) and the weight (`model.safetensors` or
`pytorch_model.bin`, key `linear.weight`, optional `linear.bias`). No projection (a plain encoder served
with `--task multivector`) gives the encoder's own per-token states. Anything else (Stanford ColBERT's
`HF_ColBERT` checkpoints with the `linear` weight inside the encoder's file, residual or non-identity
projections, several projections) is refused with a ModelDirError naming what is not supported: serving it
with the wrong projection would return vectors that look fine and rank badly.

Query and document markers come from config_sentence_transformers.json (`query_prefix`,
`document_prefix`, `query_length`, `document_length`, `do_query_expansion`,
`attend_to_expansion_tokens`, `skiplist_words`), with PyLate's defaults where a key is absent (no
markers and no expansion when the file says nothing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DENSE_MODULES = {"pylate.models.Dense.Dense", "sentence_transformers.models.Dense"}
IDENTITY = {"torch.nn.modules.linear.Identity", "Identity", None}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class Projection:
    """The linear layer after the encoder (token states -> ColBERT dimension)."""

    path: Path  # the weight file
    in_features: int
    out_features: int
    bias: bool


@dataclass(frozen=True)
class ColbertSpec:
    projection: Projection | None
    query_prefix: str = ""  # "" = no marker (a plain encoder served with --task multivector)
    document_prefix: str = ""
    query_length: int = 32
    document_length: int = 180
    expand_queries: bool = False  # pad queries to query_length with [MASK] tokens (ColBERT query augmentation)
    attend_to_expansion: bool = False  # whether the other tokens attend to those [MASK] tokens
    skiplist: tuple[str, ...] = ()  # document tokens dropped from the output (PyLate: punctuation)


def read_projection(folder: Path, error: type[ValueError]) -> Projection:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        raise error(f"the ColBERT projection {folder}/config.json cannot be read: {exc}") from exc
    activation = cfg.get("activation_function")
    if activation not in IDENTITY:
        raise error(f"the ColBERT projection in {folder.name} uses activation {activation!r}; only an identity "
                    "(linear) projection is supported")
    if cfg.get("use_residual"):
        raise error(f"the ColBERT projection in {folder.name} is residual (use_residual); not supported")
    weight = next((folder / n for n in WEIGHT_FILES if (folder / n).exists()), None)
    if weight is None:
        raise error(f"the ColBERT projection {folder} has no weight file (one of {', '.join(WEIGHT_FILES)})")
    try:
        return Projection(weight, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)))
    except (KeyError, TypeError, ValueError) as exc:
        raise error(f"{folder}/config.json needs in_features and out_features: {exc}") from exc


def read_colbert(path: Path, modules: list[dict], st_config: dict, hidden_size: int,
                 error: type[ValueError]) -> ColbertSpec:
    """The ColBERT settings of `path`; `modules` is modules.json (empty when absent)."""
    dense = [m for m in modules if m.get("type") in DENSE_MODULES]
    if len(dense) > 1:
        raise error(f"modules.json has {len(dense)} projection modules; one ColBERT projection is supported")
    projection = read_projection(path / dense[0]["path"], error) if dense else None
    if projection is not None and projection.in_features != hidden_size:
        raise error(f"the ColBERT projection takes {projection.in_features} features but the encoder's "
                    f"hidden_size is {hidden_size}")
    skiplist = st_config.get("skiplist_words") or ()
    return ColbertSpec(
        projection=projection,
        query_prefix=str(st_config.get("query_prefix") or ""),
        document_prefix=str(st_config.get("document_prefix") or ""),
        query_length=int(st_config.get("query_length") or 32),
        document_length=int(st_config.get("document_length") or 180),
        # PyLate expands queries unless told not to; a config without query_length is not PyLate's
        expand_queries=bool(st_config.get("do_query_expansion", "query_length" in st_config)),
        attend_to_expansion=bool(st_config.get("attend_to_expansion_tokens", False)),
        skiplist=tuple(str(w) for w in skiplist),
    )
