"""Tiny random models built with transformers, saved with a real tokenizer, for serving tests.

Each directory is what a user would point `--model` at; tests compare the server with
transformers' own forward pass on the same token ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from embedfleet.runtime.settings import default_model_dir

CORPUS = [
    "the quick brown fox jumps over the lazy dog", "embedding models map text to vectors",
    "rerankers score a query against a document", "classifiers put labels on texts",
    "padding must never leak into the result", "a longer sentence with many more words than the others here",
    "Ünïcödé and émojis 🚀 are text too", "numbers 12345 and symbols #@!",
] * 20


def bpe_tokenizer(path: Path) -> Tokenizer:
    """A byte-level BPE like Llama/Qwen use: <s> ... </s> around every text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.save(str(path / "tokenizer.json"))
    return tok


def bert_tokenizer(path: Path) -> None:
    src = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, path / name)


def sentence_transformers_files(path: Path, pooling: str, dim: int, prompts: dict | None = None) -> None:
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": dim, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "last"}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts or {}}))


def build_all(root: Path) -> dict[str, Path]:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        LlamaConfig,
        LlamaModel,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    torch.manual_seed(0)
    small_bert = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 64, "max_position_embeddings": 128}
    small_decoder = {"vocab_size": 400, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
                     "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    out = {}

    d = out["bert-embed"] = root / "bert-embed"
    d.mkdir()
    BertModel(BertConfig(**small_bert)).save_pretrained(d)
    bert_tokenizer(d)
    sentence_transformers_files(d, "cls", 32)

    d = out["llama-embed"] = root / "llama-embed"
    d.mkdir()
    LlamaModel(LlamaConfig(**small_decoder)).save_pretrained(d)
    bpe_tokenizer(d)
    sentence_transformers_files(d, "last", 32, {"query": "Instruct: find the passage\nQuery: "})

    d = out["bert-rerank"] = root / "bert-rerank"
    d.mkdir()
    BertForSequenceClassification(BertConfig(**small_bert, num_labels=1)).save_pretrained(d)
    bert_tokenizer(d)

    d = out["bert-classify"] = root / "bert-classify"
    d.mkdir()
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    BertForSequenceClassification(BertConfig(**small_bert, num_labels=3, id2label=labels,
                                             label2id={v: k for k, v in labels.items()})).save_pretrained(d)
    bert_tokenizer(d)

    d = out["qwen2-classify"] = root / "qwen2-classify"
    d.mkdir()
    labels = {0: "safe", 1: "unsafe"}
    Qwen2ForSequenceClassification(Qwen2Config(**small_decoder, num_labels=2, id2label=labels,
                                               label2id={v: k for k, v in labels.items()})).save_pretrained(d)
    bpe_tokenizer(d)
    return out


def bert_embedder(path: Path, seed: int) -> Path:
    """A tiny random BERT sentence embedder (mean pooling, 32 dims) whose weights follow from ``seed``: two
    seeds give two models that embed the same text differently, which is what a drift gate must refuse."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    path.mkdir()
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(path)
    bert_tokenizer(path)
    sentence_transformers_files(path, "mean", 32)
    return path


def encoder_family_embedder(root: Path, family: str, seed: int = 0) -> Path:
    """A tiny random sentence embedder (mean pooling, 32 dims) of another encoder family than BERT:
    ``roberta``, ``xlm-roberta`` or ``mpnet``, with the byte-level BPE of bpe_tokenizer (pad 0, <s> 1, </s> 2).
    What `--dtype int8` is checked against for the families the runtime serves besides BERT."""
    from transformers import MPNetConfig, MPNetModel, RobertaConfig, RobertaModel, XLMRobertaConfig, XLMRobertaModel

    classes = {"roberta": (RobertaConfig, RobertaModel), "xlm-roberta": (XLMRobertaConfig, XLMRobertaModel),
               "mpnet": (MPNetConfig, MPNetModel)}
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    path = root / f"{family}-embed"
    path.mkdir()
    model_cls(config_cls(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=130, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)).save_pretrained(path)
    bpe_tokenizer(path)
    sentence_transformers_files(path, "mean", 32)
    # MPNet's positions are offset by padding_idx + 1 like RoBERTa's, which the spec only knows for RoBERTa
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 120}))
    return path


def bert_reranker(path: Path, seed: int = 0, initializer_range: float = 0.1) -> Path:
    """A tiny random BERT cross-encoder (one logit per pair) whose scores spread: the default initialisation
    (0.02) of build_all's bert-rerank gives every pair nearly the same score (differences ~1e-5), a ranking
    any rounding reorders; wider weights give pairs scores that differ the way a trained reranker's do."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    path.mkdir()
    BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, num_labels=1, initializer_range=initializer_range)).save_pretrained(path)
    bert_tokenizer(path)
    return path


def bert_classifier(path: Path, seed: int = 0, initializer_range: float = 0.02) -> Path:
    """A tiny random BERT sequence classifier (labels negative, neutral, positive) whose weights follow from
    ``seed``: two seeds give two builds of one graph that label the same texts differently."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    path.mkdir()
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128, num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()},
        initializer_range=initializer_range)).save_pretrained(path)
    bert_tokenizer(path)
    return path
