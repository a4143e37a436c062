"""Tiny random model directories for the sparse (SPLADE) and multi-vector (ColBERT) tests.

As tests/tiny_models.py: what a user would point `--model` at, built with transformers and the
embedded model's BERT tokenizer, so the tests can compare the server with torch on the same ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from tests.tiny_models import bert_tokenizer, sentence_transformers_files

SMALL_BERT = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 128}
COLBERT = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 12, "document_length": 20,
           "do_query_expansion": True, "attend_to_expansion_tokens": False, "skiplist_words": [".", ",", "!"]}
COLBERT_DIM = 16


def build_splade(root: Path) -> Path:
    """naver's layout: a `BertForMaskedLM` checkpoint and its tokenizer, no sentence-transformers files."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(1)
    d = root / "splade"
    d.mkdir()
    BertForMaskedLM(BertConfig(**SMALL_BERT)).save_pretrained(d)
    bert_tokenizer(d)
    return d


def build_splade_st(root: Path, splade: Path, pooling: str = "max") -> Path:
    """The same weights in sentence-transformers' SparseEncoder layout (MLMTransformer + SpladePooling)."""
    d = root / f"splade-st-{pooling}"
    shutil.copytree(splade, d)
    (d / "1_SpladePooling").mkdir()
    (d / "1_SpladePooling" / "config.json").write_text(json.dumps(
        {"pooling_strategy": pooling, "activation_function": "relu", "word_embedding_dimension": 30522}))
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.models.SpladePooling"}]))
    return d


def build_dense(root: Path) -> Path:
    """A dense embedder (mean pooling), for the wrong-kind checks."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(2)
    d = root / "dense"
    d.mkdir()
    BertModel(BertConfig(**SMALL_BERT)).save_pretrained(d)
    bert_tokenizer(d)
    sentence_transformers_files(d, "mean", SMALL_BERT["hidden_size"])
    return d


def build_colbert(root: Path, activation: str = "torch.nn.modules.linear.Identity") -> Path:
    """PyLate's layout: encoder + `pylate.models.Dense.Dense` projection in 1_Dense, markers added to the
    tokenizer as tokens (PyLate's `[Q] ` / `[D] `, so the vocabulary grows by two)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(3)
    d = root / ("colbert" if "Identity" in activation else "colbert-bad")
    d.mkdir()
    bert_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(COLBERT["query_prefix"], normalized=False),
                            AddedToken(COLBERT["document_prefix"], normalized=False)])
    tok.save(str(d / "tokenizer.json"))
    BertModel(BertConfig(**{**SMALL_BERT, "vocab_size": tok.get_vocab_size()})).save_pretrained(d)
    (d / "1_Dense").mkdir()
    hidden = SMALL_BERT["hidden_size"]
    (d / "1_Dense" / "config.json").write_text(json.dumps(
        {"in_features": hidden, "out_features": COLBERT_DIM, "bias": False, "activation_function": activation}))
    save_file({"linear.weight": torch.randn(COLBERT_DIM, hidden) / hidden ** 0.5},
              str(d / "1_Dense" / "model.safetensors"))
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (d / "config_sentence_transformers.json").write_text(json.dumps(COLBERT))
    return d
