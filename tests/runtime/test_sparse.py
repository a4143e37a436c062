"""Sparse (SPLADE) embeddings over a real server: /embed_sparse and /v1/embeddings against torch's own
MLM logits, the sentence-transformers SparseEncoder layout, pruning, and wrong-kind refusals."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForMaskedLM

from embedfleet.runtime.models.spec import ModelDirError, detect_task, load_spec
from tests.asyncq.procs import start_redis
from tests.procs import start_runtime
from tests.runtime.output_models import build_dense, build_splade, build_splade_st

TEXTS = ["padding must never leak into the weights", "a", "sparse retrieval with learned term weights " * 4,
         "Ünïcödé 🚀", "the quick brown fox"]
VOCAB = 30522


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse")
    splade = build_splade(root)
    return {"splade": splade, "splade-st": build_splade_st(root, splade), "dense": build_dense(root),
            "root": root}


@pytest.fixture(scope="module")
def srv(dirs):
    redis = start_redis()
    server = start_runtime("--model", f"splade={dirs['splade']}", "--model", f"splade-st={dirs['splade-st']}",
                           "--model", f"dense={dirs['dense']}", "--redis-url", redis.url,
                           "--max-batch-requests", "8")
    yield server
    server.stop()
    redis.stop()


@torch.inference_mode()
def reference(path, texts) -> np.ndarray:
    """SPLADE computed here, one text at a time (no padding): max over tokens of log(1 + relu(logits))."""
    model = AutoModelForMaskedLM.from_pretrained(str(path)).eval()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()  # the embedded tokenizer.json pads to 128: padding is what the server must not see
    rows = []
    for text in texts:
        logits = model(input_ids=torch.tensor([tok.encode(text).ids])).logits[0]
        rows.append(torch.log1p(torch.relu(logits)).max(dim=0).values.numpy())
    return np.stack(rows)


def dense_of(items: list[dict]) -> np.ndarray:
    row = np.zeros(VOCAB, dtype=np.float32)
    for item in items:
        row[item["index"]] = item["value"]
    return row


def test_embed_sparse_matches_torch_batched_and_single(srv, dirs):
    expected = reference(dirs["splade"], TEXTS)
    with srv.client() as c:
        batched = c.post("/embed_sparse", json={"model": "splade", "inputs": TEXTS})
        assert batched.status_code == 200, batched.text
        single = [c.post("/embed_sparse", json={"model": "splade", "inputs": t}).json()[0] for t in TEXTS]
    for items in [*batched.json(), *single]:
        indices = [x["index"] for x in items]
        assert indices == sorted(indices) and len(set(indices)) == len(indices), "TEI lists terms by token id"
        assert all(x["value"] > 0 for x in items)
    got = np.stack([dense_of(items) for items in batched.json()])
    np.testing.assert_allclose(got, expected, atol=1e-4, err_msg="padding leaked into a mixed-length batch")
    np.testing.assert_allclose(np.stack([dense_of(items) for items in single]), expected, atol=1e-4)


def test_top_k_keeps_the_heaviest_terms(srv):
    with srv.client() as c:
        full = c.post("/embed_sparse", json={"model": "splade", "inputs": TEXTS}).json()
        pruned = c.post("/embed_sparse", json={"model": "splade", "inputs": TEXTS, "top_k": 7}).json()
    for whole, top in zip(full, pruned, strict=True):
        heaviest = sorted(whole, key=lambda x: (-x["value"], x["index"]))[:7]
        assert top == sorted(heaviest, key=lambda x: x["index"])


def test_openai_shape_for_sparse_models(srv):
    with srv.client() as c:
        tei = c.post("/embed_sparse", json={"model": "splade", "inputs": TEXTS[:2], "top_k": 5}).json()
        resp = c.post("/v1/embeddings", json={"model": "splade", "input": TEXTS[:2], "sparse_top_k": 5})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        full = c.post("/v1/embeddings", json={"model": "splade", "input": TEXTS[0]}).json()
    assert body["usage"]["prompt_tokens"] > 0 and [d["index"] for d in body["data"]] == [0, 1]
    for item, expected in zip(body["data"], tei, strict=True):
        assert item["embedding"]["indices"] == [x["index"] for x in expected]
        assert item["embedding"]["values"] == pytest.approx([x["value"] for x in expected], abs=1e-7)
    assert len(full["data"][0]["embedding"]["indices"]) > 5


def test_openai_sdk_gets_sparse_objects_with_its_default_base64(srv):
    """The SDK sends encoding_format=base64 unless told otherwise and decodes only string embeddings."""
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    default = client.embeddings.create(model="splade", input=TEXTS[:2], extra_body={"sparse_top_k": 4})
    floats = client.embeddings.create(model="splade", input=TEXTS[:2], encoding_format="float",
                                      extra_body={"sparse_top_k": 4})
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.embedding == b.embedding and len(a.embedding["indices"]) == len(a.embedding["values"]) == 4


def test_sentence_transformers_sparse_layout_is_detected_and_equal(srv, dirs):
    with srv.client() as c:
        raw = c.post("/embed_sparse", json={"model": "splade", "inputs": TEXTS}).json()
        st = c.post("/embed_sparse", json={"model": "splade-st", "inputs": TEXTS}).json()
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert [[x["index"] for x in r] for r in st] == [[x["index"] for x in r] for r in raw]
    assert cards["splade"]["task"] == cards["splade-st"]["task"] == "sparse"
    assert cards["splade"]["dimensions"] == VOCAB and cards["dense"]["task"] == "embed"


@pytest.mark.parametrize(("route", "body", "status", "words"), [
    ("/embed_sparse", {"model": "dense", "inputs": "x"}, 400, "sparse (SPLADE) model"),
    ("/embed", {"model": "splade", "inputs": "x"}, 400, "is a sparse (SPLADE) model"),
    ("/rerank", {"model": "splade", "query": "q", "texts": ["d"]}, 400, "sparse"),
    ("/v1/embeddings", {"model": "splade", "input": "x", "encoding_format": "int8"}, 422, "encoding_format"),
    ("/v1/embeddings", {"model": "splade", "input": "x", "dimensions": 8}, 422, "sparse_top_k"),
    ("/v1/embeddings", {"model": "dense", "input": "x", "sparse_top_k": 8}, 422, "sparse models only"),
    ("/embed_sparse", {"model": "splade", "inputs": "x", "top_k": 0}, 422, "top_k"),
    ("/embed_sparse", {"model": "splade", "inputs": ""}, 422, "input 0"),
    ("/async/v1/embeddings", {"model": "splade", "input": "x"}, 400, "sparse (SPLADE) model"),
])
def test_wrong_kind_and_bad_input_then_still_serving(srv, route, body, status, words):
    with srv.client() as c:
        resp = c.post(route, json=body)
        assert resp.status_code == status, resp.text
        assert words.lower() in resp.json()["error"]["message"].lower(), resp.text
        ok = c.post("/embed_sparse", json={"model": "splade", "inputs": "still serving"})
        assert ok.status_code == 200 and ok.json()[0]


def test_task_detection_and_refusals(dirs, tmp_path):
    # dense sentence-transformers models often declare *ForMaskedLM (all-mpnet-base-v2): modules decide
    assert detect_task(("MPNetForMaskedLM",), 2, ("sentence_transformers.models.Transformer",
                                                  "sentence_transformers.models.Pooling")) == "embed"
    assert detect_task(("BertForMaskedLM",), 2) == "sparse"
    assert load_spec(dirs["splade"], task="embed").task == "embed"  # --task embed serves the encoder, pooled
    with pytest.raises(ModelDirError, match="MLM head"):
        load_spec(dirs["dense"], task="sparse")
    with pytest.raises(ModelDirError, match="pooling_strategy='sum'"):
        load_spec(build_splade_st(tmp_path, dirs["splade"], pooling="sum"))
