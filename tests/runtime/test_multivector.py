"""Multi-vector (ColBERT) outputs over a real server: /embed_all and MaxSim rerank against torch on a
tiny random PyLate-layout model (markers, [MASK] query expansion, skiplist, projection)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModel

from embedfleet.runtime.models.spec import ModelDirError, load_spec
from tests.asyncq.procs import start_redis
from tests.procs import start_runtime
from tests.runtime.output_models import COLBERT, COLBERT_DIM, build_colbert, build_dense

DOCS = ["padding must never leak, not once.", "a", "late interaction scores every query token!",
        "the quick brown fox jumps over the lazy dog", "Ünïcödé 🚀"]
QUERIES = ["which text is about padding", "fox", "late interaction"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("colbert")
    return {"colbert": build_colbert(root), "dense": build_dense(root)}


@pytest.fixture(scope="module")
def srv(dirs):
    redis = start_redis()
    server = start_runtime("--model", f"colbert={dirs['colbert']}", "--model", f"dense={dirs['dense']}",
                           "--redis-url", redis.url, "--max-batch-requests", "4")
    yield server
    server.stop()
    redis.stop()


class Reference:
    """ColBERT as PyLate computes it, written out in torch, one text at a time (no padding)."""

    def __init__(self, path) -> None:
        self.model = AutoModel.from_pretrained(str(path)).eval()
        self.weight = load_file(str(path / "1_Dense" / "model.safetensors"))["linear.weight"]
        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tok.no_truncation()
        self.tok.no_padding()
        self.skip = {self.tok.token_to_id(w) for w in COLBERT["skiplist_words"]}

    @torch.inference_mode()
    def vectors(self, text: str, query: bool) -> np.ndarray:
        ids = self.tok.encode(text).ids
        marker = self.tok.token_to_id(COLBERT["query_prefix" if query else "document_prefix"])
        ids = [ids[0], marker, *ids[1:]]
        mask = [1] * len(ids)
        if query:  # expansion: [MASK] up to query_length, encoded but not attended to
            extra = COLBERT["query_length"] - len(ids)
            ids, mask = ids + [self.tok.token_to_id("[MASK]")] * extra, mask + [0] * extra
        hidden = self.model(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([mask])).last_hidden_state[0]
        out = torch.nn.functional.normalize(hidden @ self.weight.T, dim=-1)
        if not query:
            out = out[[i for i, t in enumerate(ids) if t not in self.skip]]
        return out.numpy()

    def maxsim(self, query: str, doc: str) -> float:
        return float((self.vectors(query, True) @ self.vectors(doc, False).T).max(axis=1).sum())


@pytest.fixture(scope="module")
def ref(dirs) -> Reference:
    return Reference(dirs["colbert"])


def test_embed_all_documents_and_queries_match_torch(srv, ref):
    with srv.client() as c:
        docs = c.post("/embed_all", json={"model": "colbert", "inputs": DOCS})
        assert docs.status_code == 200, docs.text
        single = [c.post("/embed_all", json={"model": "colbert", "inputs": d}).json()[0] for d in DOCS]
        queries = c.post("/embed_all", json={"model": "colbert", "inputs": QUERIES, "input_type": "query"}).json()
    for text, batched, alone in zip(DOCS, docs.json(), single, strict=True):
        expected = ref.vectors(text, query=False)
        assert np.asarray(batched).shape == expected.shape == (len(expected), COLBERT_DIM)
        np.testing.assert_allclose(batched, expected, atol=1e-4, err_msg=f"document {text!r} (batched)")
        np.testing.assert_allclose(alone, expected, atol=1e-4)
        np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    for text, got in zip(QUERIES, queries, strict=True):
        assert len(got) == COLBERT["query_length"], "queries are expanded with [MASK] to query_length"
        np.testing.assert_allclose(got, ref.vectors(text, query=True), atol=1e-4, err_msg=f"query {text!r}")


def test_skiplist_tokens_are_dropped_from_documents(srv, ref):
    text = "padding, never. leaks!"
    ids = ref.tok.encode(text).ids
    with srv.client() as c:
        got = c.post("/embed_all", json={"model": "colbert", "inputs": text}).json()[0]
    assert len(got) == len(ids) + 1 - 3  # + the [D] marker, - the three punctuation tokens


@pytest.mark.parametrize("query", QUERIES)
def test_rerank_is_maxsim_in_every_shape(srv, ref, query):
    expected = np.array([ref.maxsim(query, d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: (-expected[i], i))
    with srv.client() as c:
        tei = c.post("/rerank", json={"model": "colbert", "query": query, "texts": DOCS, "return_text": True})
        assert tei.status_code == 200, tei.text
        cohere = c.post("/v1/rerank", json={"model": "colbert", "query": query, "documents": DOCS, "top_n": 2,
                                            "return_documents": True}).json()
        cohere_on_rerank = c.post("/rerank", json={"model": "colbert", "query": query, "documents": DOCS}).json()
    assert [r["index"] for r in tei.json()] == order
    assert [r["score"] for r in tei.json()] == pytest.approx(expected[order].tolist(), abs=1e-3)
    assert [r["text"] for r in tei.json()] == [DOCS[i] for i in order]
    assert [r["index"] for r in cohere["results"]] == order[:2]
    assert [r["document"]["text"] for r in cohere["results"]] == [DOCS[i] for i in order[:2]]
    assert [r["relevance_score"] for r in cohere_on_rerank["results"]] == pytest.approx(expected[order].tolist(),
                                                                                       abs=1e-3)


def test_documents_truncate_to_document_length(srv):
    long = "late interaction keeps one vector per token " * 5
    with srv.client() as c:
        cut = c.post("/embed_all", json={"model": "colbert", "inputs": long, "truncate": True})
        refused = c.post("/embed_all", json={"model": "colbert", "inputs": long, "truncate": False})
    assert cut.status_code == 200 and len(cut.json()[0]) == COLBERT["document_length"]
    assert refused.status_code == 413 and "document length" in refused.json()["error"]["message"]


def test_model_card_says_multivector(srv):
    with srv.client() as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
    assert cards["colbert"]["task"] == "multivector" and cards["colbert"]["dimensions"] == COLBERT_DIM


@pytest.mark.parametrize(("route", "body", "words"), [
    ("/embed_all", {"model": "dense", "inputs": "x"}, "multi-vector (ColBERT) model"),
    ("/embed", {"model": "colbert", "inputs": "x"}, "is a multi-vector (ColBERT) model"),
    ("/v1/embeddings", {"model": "colbert", "input": "x"}, "is a multi-vector"),
    ("/rerank", {"model": "dense", "query": "q", "texts": ["d"]}, "reranker (cross-encoder) or a multi-vector"),
    ("/async/rerank", {"model": "colbert", "query": "q", "texts": ["d"]}, "is a multi-vector"),
])
def test_wrong_kind_is_400_and_the_server_keeps_serving(srv, route, body, words):
    with srv.client() as c:
        resp = c.post(route, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "wrong_model_kind"
        assert words.lower() in resp.json()["error"]["message"].lower()
        ok = c.post("/embed_all", json={"model": "colbert", "inputs": "still serving"})
        assert ok.status_code == 200 and len(ok.json()[0]) > 0


def test_unsupported_colbert_layouts_are_refused(dirs, tmp_path):
    with pytest.raises(ModelDirError, match="activation"):
        load_spec(build_colbert(tmp_path, activation="torch.nn.modules.activation.Tanh"))
    stanford = tmp_path / "stanford"
    shutil.copytree(dirs["dense"], stanford)
    config = json.loads((stanford / "config.json").read_text())
    (stanford / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    with pytest.raises(ModelDirError, match="HF_ColBERT"):
        load_spec(stanford)
    # a plain encoder can be served per token (no projection, no markers)
    plain = load_spec(dirs["dense"], task="multivector")
    assert plain.colbert is not None and plain.colbert.projection is None and plain.output_dim == 32


def test_a_split_server_answers_as_the_single_process(srv, dirs):
    """`--fronts 2`: ColBERT's marked inputs (attended counts, [MASK] expansion) cross the link intact."""
    split = start_runtime("--model", f"colbert={dirs['colbert']}", "--model", f"dense={dirs['dense']}",
                          "--max-batch-requests", "4", "--fronts", "2")
    try:
        cases = [("/rerank", {"model": "colbert", "query": QUERIES[0], "texts": DOCS, "return_text": True}),
                 ("/v1/rerank", {"model": "colbert", "query": QUERIES[2], "documents": DOCS}),
                 ("/embed_all", {"model": "colbert", "inputs": QUERIES, "input_type": "query"}),
                 ("/embed_all", {"model": "colbert", "inputs": DOCS})]
        with srv.client() as one, split.client() as two:
            for path, body in cases:
                want, got = one.post(path, json=body), two.post(path, json=body)
                assert want.status_code == 200 and got.status_code == 200, (want.text, got.text)
                if isinstance(want.json(), dict):  # Cohere's shape carries a fresh id per answer
                    assert {**got.json(), "id": ""} == {**want.json(), "id": ""}, path
                else:
                    assert got.content == want.content, path
    finally:
        split.stop()
