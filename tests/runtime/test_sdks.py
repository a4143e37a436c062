"""Cohere's SDK (ClientV2: embed, rerank) and Hugging Face's InferenceClient (feature_extraction,
text_classification) work unchanged against a real server process."""

from __future__ import annotations

import base64

import cohere
import huggingface_hub.constants
import numpy as np
import pytest
import torch
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError
from sentence_transformers import quantize_embeddings
from transformers import BertConfig, BertForSequenceClassification, BertModel

from tests.procs import start_runtime
from tests.tiny_models import bert_tokenizer, sentence_transformers_files

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["the quick brown fox", "rerankers score a query against a document", "Ünïcödé 🚀"]
QUERY = "which text talks about rerankers"
PROMPTS = {"query": "query: ", "passage": "passage: "}
SMALL_BERT = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A classifier first (the model POST / serves), an embedder with query/passage prompts, a reranker."""
    root = tmp_path_factory.mktemp("sdk-models")
    torch.manual_seed(0)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    models = {
        "clf": BertForSequenceClassification(BertConfig(**SMALL_BERT, num_labels=3, id2label=labels,
                                                        label2id={v: k for k, v in labels.items()})),
        "emb": BertModel(BertConfig(**SMALL_BERT)),
        "rr": BertForSequenceClassification(BertConfig(**SMALL_BERT, num_labels=1)),
    }
    flags = []
    for name, model in models.items():
        d = root / name
        d.mkdir()
        model.save_pretrained(d)
        bert_tokenizer(d)
        if name == "emb":
            sentence_transformers_files(d, "cls", 32, PROMPTS)
        flags += ["--model", f"{name}={d}"]
    srv = start_runtime(*flags)
    yield srv
    srv.stop()


@pytest.fixture
def hf_online(monkeypatch):
    """InferenceClient refuses every URL, loopback included, while HF_HUB_OFFLINE is set (tests/conftest.py
    sets it so nothing loads from the Hub); allow it in this process only. The server stays offline."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def cohere_client(srv) -> cohere.ClientV2:
    return cohere.ClientV2(base_url=srv.url, api_key="unused")


def test_cohere_embed_types_and_quantisation(server):
    client = cohere_client(server)
    resp = client.embed(model=MODEL, texts=TEXTS, input_type="search_query", output_dimension=64,
                        embedding_types=["float", "int8", "uint8", "binary", "ubinary", "base64"])
    floats = np.array(resp.embeddings.float_, dtype=np.float32)
    assert floats.shape == (len(TEXTS), 64) and resp.texts == TEXTS
    expected = server.client().post("/v1/embeddings", json={"model": MODEL, "input": TEXTS, "dimensions": 64}).json()
    np.testing.assert_allclose(floats, [d["embedding"] for d in expected["data"]], atol=1e-6)
    b64 = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in resp.embeddings.base64])
    np.testing.assert_array_equal(b64, floats)
    info = server.client().get(f"/v1/models/{MODEL}/quantization", params={"dimensions": 64}).json()
    ranges = np.array(info["ranges"])
    for precision in ("int8", "uint8", "binary", "ubinary"):
        got = np.array(getattr(resp.embeddings, precision))
        np.testing.assert_array_equal(got, quantize_embeddings(floats, precision, ranges=ranges), err_msg=precision)
    assert resp.meta.billed_units.input_tokens > 0
    default = client.embed(model=MODEL, texts=["x"], input_type="search_document")  # no types: float only
    assert len(default.embeddings.float_[0]) == 384 and default.embeddings.int8 is None
    spec = server.client().get("/openapi.json").json()
    assert {"/v2/embed", "/v2/rerank", "/", "/v1/models/{model}/quantization"} <= set(spec["paths"])
    assert {"CohereEmbedRequest", "CohereV2RerankRequest"} <= set(spec["components"]["schemas"])


def test_cohere_input_type_uses_model_prompts(tiny):
    client = cohere_client(tiny)
    with tiny.client() as c:
        for input_type, prompt in (("search_query", "query"), ("search_document", "passage")):
            got = client.embed(model="emb", texts=TEXTS, input_type=input_type, embedding_types=["float"])
            want = c.post("/v1/embeddings", json={"model": "emb", "input": TEXTS, "prompt_name": prompt}).json()
            np.testing.assert_allclose(got.embeddings.float_, [d["embedding"] for d in want["data"]], atol=1e-6)
        plain = client.embed(model="emb", texts=TEXTS, input_type="clustering", embedding_types=["float"])
        want = c.post("/v1/embeddings", json={"model": "emb", "input": TEXTS}).json()  # no clustering prompt
        np.testing.assert_allclose(plain.embeddings.float_, [d["embedding"] for d in want["data"]], atol=1e-6)
        assert not np.allclose(plain.embeddings.float_, got.embeddings.float_, atol=1e-3)


def test_cohere_truncate(tiny):
    client = cohere_client(tiny)
    long_text = "the start " + "words " * 400 + " the end"  # over the tiny model's input limit
    with pytest.raises(cohere.BadRequestError) as exc:
        client.embed(model="emb", texts=[long_text], input_type="search_query", truncate="NONE")
    assert "truncate" in exc.value.body["message"]
    with tiny.client() as c:
        for truncate, direction in (("START", "left"), ("END", "right")):
            got = client.embed(model="emb", texts=[long_text], input_type="clustering", truncate=truncate)
            want = c.post("/v1/embeddings", json={"model": "emb", "input": long_text, "truncate": True,
                                                  "truncation_direction": direction}).json()
            np.testing.assert_allclose(got.embeddings.float_, [want["data"][0]["embedding"]], atol=1e-6)
            assert got.meta.billed_units.input_tokens == want["usage"]["prompt_tokens"] < 400
    short = client.embed(model="emb", texts=[long_text], input_type="clustering", max_tokens=10)
    assert short.meta.billed_units.input_tokens == 10


def test_cohere_rerank_matches_v1_rerank(tiny):
    resp = cohere_client(tiny).rerank(model="rr", query=QUERY, documents=TEXTS, top_n=2)
    want = tiny.client().post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": TEXTS}).json()
    assert [(r.index, pytest.approx(r.relevance_score, abs=1e-6)) for r in resp.results] == \
        [(r["index"], r["relevance_score"]) for r in want["results"][:2]]
    assert resp.results[0].relevance_score >= resp.results[1].relevance_score
    assert resp.meta.billed_units.input_tokens > 0 and resp.id


def test_cohere_errors_in_cohere_shape(server, tiny):
    client = cohere_client(server)
    with pytest.raises(cohere.UnprocessableEntityError) as exc:
        client.embed(model=MODEL, texts=["x"], input_type="search_query", embedding_types=["int4"])
    assert "embedding_types" in exc.value.body["message"]
    with pytest.raises(cohere.UnprocessableEntityError) as exc:
        client.embed(model=MODEL, texts=[], input_type="search_query")
    assert "empty" in exc.value.body["message"]
    with pytest.raises(cohere.UnprocessableEntityError) as exc:
        client.embed(model=MODEL, texts=["x"], input_type="image")
    assert "input_type" in exc.value.body["message"]
    with pytest.raises(cohere.BadRequestError) as exc:
        client.rerank(model=MODEL, query=QUERY, documents=TEXTS)
    assert exc.value.body["code"] == "wrong_model_kind" and "reranker" in exc.value.body["message"]
    with pytest.raises(cohere.BadRequestError) as exc:
        cohere_client(tiny).embed(model="rr", texts=["x"], input_type="search_query")
    assert exc.value.body["code"] == "wrong_model_kind"
    with pytest.raises(cohere.NotFoundError) as exc:
        client.embed(model="not-served", texts=["x"], input_type="search_query")
    assert "not-served" in exc.value.body["message"]
    assert client.embed(model=MODEL, texts=["still serving"], input_type="search_query").embeddings.float_


def test_hf_feature_extraction(server, hf_online):
    client = InferenceClient(base_url=server.url)
    got = client.feature_extraction("hello from the Hugging Face client")
    want = server.client().post("/embed", json={"inputs": "hello from the Hugging Face client"}).json()
    assert got.shape == (1, 384)
    np.testing.assert_allclose(got, want, atol=1e-6)
    raw = client.feature_extraction("hello", normalize=False, dimensions=16)
    assert raw.shape == (1, 16) and abs(np.linalg.norm(raw) - 1) > 1e-3
    with pytest.raises(HfHubHTTPError) as exc:
        client.feature_extraction("   ")
    assert exc.value.response.status_code == 422 and "empty" in str(exc.value)


def test_hf_text_classification(tiny, hf_online):
    client = InferenceClient(base_url=tiny.url)
    got = client.text_classification(TEXTS[0])
    want = tiny.client().post("/classify", json={"model": "clf", "input": TEXTS[0]}).json()["data"][0]["labels"]
    assert [(g.label, pytest.approx(g.score, abs=1e-6)) for g in got] == [(w["label"], w["score"]) for w in want]
    assert len(got) == 3 and sum(g.score for g in got) == pytest.approx(1, abs=1e-5)
    top = client.text_classification(TEXTS[0], top_k=2, function_to_apply="none")
    raw = tiny.client().post("/classify", json={"model": "clf", "input": TEXTS[0], "raw_scores": True}).json()
    assert [(t.label, pytest.approx(t.score, abs=1e-5)) for t in top] == \
        [(w["label"], w["score"]) for w in raw["data"][0]["labels"][:2]]
