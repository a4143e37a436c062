"""The server's vectors equal sentence-transformers' for the same model and texts."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from embedfleet.runtime.settings import default_model_dir

LONG = " ".join(f"word{i} and some filler text about topic {i % 7}" for i in range(200))  # >> 256 tokens
TEXTS = [
    "hello world", "a", "?", "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade — naïve café, 東京は日本の首都です。", "Emoji test 🚀🔥 and symbols ∑∫√",
    "   leading and trailing spaces   ", "UPPER lower MiXeD", "numbers 1234567890 3.14159 1e-9",
    "line\nbreaks\tand\ttabs", "code: def f(x): return x ** 2", "https://example.com/path?q=1&r=2",
    "Ein deutscher Satz über Einbettungen.", "Une phrase française sur les plongements.",
    "Una frase en español sobre incrustaciones.", "Русский текст про векторные представления.",
    "short", "medium length sentence about embeddings and retrieval systems in production",
    LONG, LONG[::-1], "x " * 300, "repeated repeated repeated " * 40,
    *[f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 9) for i in range(16)],
]


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(default_model_dir()), device="cpu")


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def test_openai_route_matches_sentence_transformers(server, reference):
    expected = reference.encode(TEXTS, normalize_embeddings=True)
    with server.client() as c:
        body = c.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": TEXTS}).json()
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert got.shape == expected.shape == (len(TEXTS), 384)
    assert cosine_rows(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(TEXTS)


def test_one_at_a_time_equals_batched(server):
    """Padding inside a mixed-length batch must not leak into any row."""
    with server.client() as c:
        batched = np.array([d["embedding"] for d in c.post("/v1/embeddings", json={"input": TEXTS[:8]}).json()["data"]])
        single = np.array([c.post("/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"]
                           for t in TEXTS[:8]])
    assert cosine_rows(batched, single).min() >= 0.99999


def test_base64_is_little_endian_float32(server):
    with server.client() as c:
        floats = c.post("/v1/embeddings", json={"input": ["hello world"]}).json()["data"][0]["embedding"]
        b64 = c.post("/v1/embeddings", json={"input": ["hello world"], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, np.array(floats, dtype=np.float32), rtol=0, atol=1e-7)


def test_matryoshka_dimensions_are_sliced_then_renormalised(server):
    with server.client() as c:
        full = np.array(c.post("/v1/embeddings", json={"input": "matryoshka"}).json()["data"][0]["embedding"])
        cut = np.array(c.post("/v1/embeddings", json={"input": "matryoshka", "dimensions": 64})
                       .json()["data"][0]["embedding"])
    assert cut.shape == (64,)
    assert abs(np.linalg.norm(cut) - 1.0) < 1e-5
    np.testing.assert_allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_token_id_input_equals_text_input(server):
    with server.client() as c:
        ids = [t["id"] for t in c.post("/tokenize", json={"inputs": "hello world"}).json()[0]]
        from_text = c.post("/v1/embeddings", json={"input": "hello world"}).json()
        from_ids = c.post("/v1/embeddings", json={"input": [ids]}).json()
    assert ids[0] == 101 and ids[-1] == 102  # [CLS] ... [SEP]
    np.testing.assert_allclose(from_ids["data"][0]["embedding"], from_text["data"][0]["embedding"], atol=1e-6)
    assert from_ids["usage"]["prompt_tokens"] == len(ids)


def test_tei_embed_route(server, reference):
    texts = ["hello world", "Ünïcödé façade"]
    with server.client() as c:
        normed = np.array(c.post("/embed", json={"inputs": texts}).json())
        raw = np.array(c.post("/embed", json={"inputs": texts, "normalize": False}).json())
        single = c.post("/embed", json={"inputs": "hello world"}).json()
    assert cosine_rows(normed, reference.encode(texts, normalize_embeddings=True)).min() >= 0.9999
    assert np.linalg.norm(raw, axis=1).min() > 1.01  # MiniLM's mean-pooled vectors are not unit length
    assert len(single) == 1 and len(single[0]) == 384


def test_truncation_right_matches_reference_and_left_keeps_the_end(server, reference):
    with server.client() as c:
        right = c.post("/v1/embeddings", json={"input": [LONG], "truncate": True}).json()
        left = c.post("/v1/embeddings", json={"input": [LONG], "truncate": True,
                                               "truncation_direction": "left"}).json()
        tail_only = c.post("/v1/embeddings", json={"input": [LONG[-900:]], "truncate": True,
                                                    "truncation_direction": "left"}).json()
    r = np.array([right["data"][0]["embedding"]])
    assert cosine_rows(r, reference.encode([LONG], normalize_embeddings=True))[0] >= 0.9999
    assert right["usage"]["prompt_tokens"] == 256
    assert left["usage"]["prompt_tokens"] == 256
    lv, tv = np.array([left["data"][0]["embedding"]]), np.array([tail_only["data"][0]["embedding"]])
    assert cosine_rows(lv, r)[0] < 0.99  # a different window of the text
    assert cosine_rows(lv, tv)[0] > 0.9  # mostly the same tokens as the text's end


def test_too_long_without_truncation_names_index_and_count(server):
    with server.client() as c:
        resp = c.post("/embed", json={"inputs": ["fine", LONG], "truncate": False})
        assert resp.status_code == 413
        message = resp.json()["error"]["message"]
        assert "input 1" in message and "256" in message
        count = len(c.post("/tokenize", json={"inputs": LONG}).json()[0])
        assert str(count) in message
        assert c.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_tokenize_offsets(server):
    with server.client() as c:
        tokens = c.post("/tokenize", json={"inputs": ["hello world"], "add_special_tokens": False}).json()[0]
    assert [t["text"] for t in tokens] == ["hello", "world"]
    assert [(t["start"], t["stop"]) for t in tokens] == [(0, 5), (6, 11)]
