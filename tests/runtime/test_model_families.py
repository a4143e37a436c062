"""Every model family through one real multi-model server, checked against transformers' own forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModel, AutoModelForSequenceClassification

from tests.tiny_models import build_all

TEXTS = ["padding must never leak", "a", "a much longer text with many more words than the short one " * 3,
         "Ünïcödé 🚀", "the quick brown fox"]
QUERY = "which text talks about padding"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_all(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def multi(tiny, tmp_path_factory):
    from tests.procs import start_runtime

    flags = []
    for name, path in tiny.items():
        flags += ["--model", f"{name}={path}"]
    srv = start_runtime(*flags, "--max-batch-requests", "16")
    yield srv
    srv.stop()


def reference_ids(path, texts, pairs=False):
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return [tok.encode(*t) if pairs else tok.encode(t) for t in texts]


@torch.inference_mode()
def reference_embed(path, texts, pooling):
    model = AutoModel.from_pretrained(str(path)).eval()
    rows = []
    for enc in reference_ids(path, texts):
        hidden = model(input_ids=torch.tensor([enc.ids])).last_hidden_state[0]
        v = hidden[0] if pooling == "cls" else hidden[-1]
        rows.append((v / v.norm()).numpy())
    return np.stack(rows)


@torch.inference_mode()
def reference_logits(path, items, pairs=False):
    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    out = []
    for enc in reference_ids(path, items, pairs):
        kwargs = {"input_ids": torch.tensor([enc.ids])}
        if pairs and "bert" in path.name:
            kwargs["token_type_ids"] = torch.tensor([enc.type_ids])
        out.append(model(**kwargs).logits[0].numpy())
    return np.stack(out)


def cos(a, b):
    a = np.asarray(a) / np.linalg.norm(a, axis=-1, keepdims=True)
    b = np.asarray(b) / np.linalg.norm(b, axis=-1, keepdims=True)
    return (a * b).sum(-1)


@pytest.mark.parametrize(("name", "pooling"), [("bert-embed", "cls"), ("llama-embed", "last")])
def test_embedders_match_transformers_batched_and_single(multi, tiny, name, pooling):
    expected = reference_embed(tiny[name], TEXTS, pooling)
    with multi.client() as c:
        batched = [d["embedding"] for d in c.post("/v1/embeddings", json={"model": name, "input": TEXTS})
                   .json()["data"]]
        single = [c.post("/embed", json={"model": name, "inputs": t}).json()[0] for t in TEXTS]
    assert cos(batched, expected).min() >= 0.9999, "padding leaked into a mixed-length batch"
    assert cos(single, expected).min() >= 0.9999


def test_decoder_prompt_prefix(multi, tiny):
    prefix = "Instruct: find the passage\nQuery: "
    with multi.client() as c:
        by_name = c.post("/embed", json={"model": "llama-embed", "inputs": ["fox"], "prompt_name": "query"}).json()
        raw = c.post("/v1/embeddings", json={"model": "llama-embed", "input": ["fox"], "instruction": prefix}).json()
        unknown = c.post("/embed", json={"model": "llama-embed", "inputs": ["fox"], "prompt_name": "nope"})
    expected = reference_embed(tiny["llama-embed"], [prefix + "fox"], "last")
    assert cos(by_name, expected).min() >= 0.9999
    assert cos([raw["data"][0]["embedding"]], expected).min() >= 0.9999
    assert unknown.status_code == 422 and "query" in unknown.json()["error"]["message"]


def test_rerank_tei_shape(multi, tiny):
    docs = TEXTS
    logits = reference_logits(tiny["bert-rerank"], [(QUERY, d) for d in docs], pairs=True)[:, 0]
    expected = 1 / (1 + np.exp(-logits))
    with multi.client() as c:
        ranked = c.post("/rerank", json={"model": "bert-rerank", "query": QUERY, "texts": docs,
                                         "return_text": True}).json()
        raw = c.post("/rerank", json={"model": "bert-rerank", "query": QUERY, "texts": docs,
                                      "raw_scores": True}).json()
    assert [r["index"] for r in ranked] == list(np.argsort(-expected, kind="stable"))
    for r in ranked:
        assert abs(r["score"] - expected[r["index"]]) < 1e-4
        assert r["text"] == docs[r["index"]]
    assert all(abs(r["score"] - logits[r["index"]]) < 1e-4 and "text" not in r for r in raw)


def test_rerank_cohere_shape(multi, tiny):
    docs = [TEXTS[0], {"text": TEXTS[2]}, TEXTS[4]]
    texts = [TEXTS[0], TEXTS[2], TEXTS[4]]
    expected = 1 / (1 + np.exp(-reference_logits(tiny["bert-rerank"], [(QUERY, d) for d in texts], True)[:, 0]))
    with multi.client() as c:
        for route in ("/v1/rerank", "/rerank"):
            body = c.post(route, json={"model": "bert-rerank", "query": QUERY, "documents": docs, "top_n": 2,
                                       "return_documents": True}).json()
            assert [r["index"] for r in body["results"]] == list(np.argsort(-expected, kind="stable"))[:2]
            for r in body["results"]:
                assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4
                assert r["document"]["text"] == texts[r["index"]]
            assert body["model"] == "bert-rerank" and body["usage"]["total_tokens"] > 0


def test_large_rerank_is_packed_by_tokens(multi):
    docs = [f"document number {i} " + "word " * (i % 40) for i in range(500)]
    before = multi.metric("embedfleet_batch_size_count", model="bert-rerank")
    with multi.client() as c:
        ranked = c.post("/rerank", json={"model": "bert-rerank", "query": QUERY, "texts": docs}).json()
    batches = multi.metric("embedfleet_batch_size_count", model="bert-rerank") - before
    assert sorted(r["index"] for r in ranked) == list(range(500))
    assert batches >= 500 / 16, "500 pairs must be split into engine batches of at most 16"


@pytest.mark.parametrize("name", ["bert-classify", "qwen2-classify"])
def test_classify_and_predict_match_transformers(multi, tiny, name):
    logits = reference_logits(tiny[name], TEXTS)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = {"bert-classify": ["negative", "neutral", "positive"], "qwen2-classify": ["safe", "unsafe"]}[name]
    with multi.client() as c:
        classified = c.post("/classify", json={"model": name, "input": TEXTS}).json()
        predicted = c.post("/predict", json={"model": name, "inputs": TEXTS[:1] + TEXTS[2:]}).json()
        one = c.post("/predict", json={"model": name, "inputs": TEXTS[0], "raw_scores": True}).json()
    for row, item in zip(probs, classified["data"], strict=True):
        got = {ls["label"]: ls["score"] for ls in item["labels"]}
        assert item["label"] == labels[int(row.argmax())]
        assert all(abs(got[labels[k]] - row[k]) < 1e-4 for k in range(len(labels)))
    assert len(predicted) == len(TEXTS) - 1
    assert abs(predicted[1][0]["score"] - probs[2].max()) < 1e-4
    assert {ls["label"]: ls["score"] for ls in one}[labels[0]] == pytest.approx(float(logits[0][0]), abs=1e-4)


def test_predict_pairs_on_reranker(multi, tiny):
    logits = reference_logits(tiny["bert-rerank"], [(QUERY, TEXTS[0]), (QUERY, TEXTS[2])], pairs=True)
    with multi.client() as c:
        pair = c.post("/predict", json={"model": "bert-rerank", "inputs": [QUERY, TEXTS[0]],
                                        "raw_scores": True}).json()
        batch = c.post("/predict", json={"model": "bert-rerank", "inputs": [[QUERY, TEXTS[0]], [QUERY, TEXTS[2]]],
                                         "raw_scores": True}).json()
        singles = c.post("/predict", json={"model": "bert-rerank", "inputs": ["a", "b", "c"]})
    assert pair[0]["score"] == pytest.approx(float(logits[0][0]), abs=1e-4)
    assert [b[0]["score"] for b in batch] == pytest.approx(logits[:, 0].tolist(), abs=1e-4)
    assert singles.status_code == 422 and "pair" in singles.json()["error"]["message"]


def test_wrong_model_kind_is_refused_and_models_are_listed(multi):
    with multi.client() as c:
        cases = [("/rerank", {"model": "bert-embed", "query": "q", "texts": ["d"]}),
                 ("/v1/embeddings", {"model": "bert-rerank", "input": "x"}),
                 ("/classify", {"model": "llama-embed", "input": "x"}),
                 ("/embed", {"model": "qwen2-classify", "inputs": "x"})]
        for route, body in cases:
            resp = c.post(route, json=body)
            assert resp.status_code == 400, (route, resp.text)
            assert body["model"] in resp.json()["error"]["message"]
        assert c.post("/rerank", json={"model": "missing", "query": "q", "texts": ["d"]}).status_code == 404
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        # with no `model`, each route picks the first model of its kind
        assert c.post("/rerank", json={"query": "q", "texts": ["d"]}).status_code == 200
    assert set(listed) == {"bert-embed", "llama-embed", "bert-rerank", "bert-classify", "qwen2-classify"}
    assert listed["bert-rerank"]["task"] == "rerank" and listed["qwen2-classify"]["labels"] == ["safe", "unsafe"]
    assert listed["llama-embed"]["pooling"] == "last" and listed["bert-embed"]["pooling"] == "cls"


def test_task_override_and_mismatch(tiny, runtime_factory):
    from tests.procs import start_runtime

    srv = start_runtime("--model", f"classify:{tiny['bert-rerank']}", wait_ready=True)
    try:
        with srv.client() as c:
            out = c.post("/classify", json={"input": "x"}).json()
        assert out["data"][0]["labels"][0]["label"] == "LABEL_0"
    finally:
        srv.stop()
    bad = start_runtime("--model", f"rerank:{tiny['bert-embed']}", wait_ready=False)
    assert bad.proc.wait(120) == 1
    assert "ForSequenceClassification" in bad.log()
