"""Quantised outputs equal sentence-transformers' quantize_embeddings of the server's own float vectors,
with the ranges the server publishes (GET /v1/models/{model}/quantization)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from sentence_transformers import quantize_embeddings
from transformers import BertConfig, BertModel

from embedfleet.runtime.core.quantize import CALIBRATION_TEXTS, Calibration, quantize
from tests.tiny_models import bert_tokenizer, sentence_transformers_files

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["the quick brown fox", "quantised vectors keep most of the ranking quality",
         "Ünïcödé 🚀 text", "a longer text about central banks, interest rates and inflation " * 3]
DTYPES = {"int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


def floats_of(srv, texts, dimensions=None) -> np.ndarray:
    """The server's float32 vectors, bit-exact (base64 float32 bytes, no decimal detour)."""
    body = {"model": MODEL, "input": texts, "encoding_format": "base64", "dimensions": dimensions}
    data = srv.client().post("/v1/embeddings", json=body).raise_for_status().json()["data"]
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])


def published_ranges(srv, model=MODEL, dimensions=None) -> dict:
    params = {"dimensions": dimensions} if dimensions else {}
    return srv.client().get(f"/v1/models/{model}/quantization", params=params).raise_for_status().json()


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_quantize_is_sentence_transformers_arithmetic(precision):
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(64, 45)).astype(np.float32)  # 45 dims: packbits pads the last byte
    calibration = rng.normal(size=(200, 45)).astype(np.float32)
    cal = Calibration(calibration, "test")
    ranges = cal.ranges()
    unit = calibration / np.linalg.norm(calibration, axis=1, keepdims=True)
    np.testing.assert_array_equal(ranges, np.vstack((unit.min(0), unit.max(0))))
    ours = quantize(vectors, precision, ranges)
    theirs = quantize_embeddings(vectors, precision, ranges=ranges)
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(ours, theirs)
    if precision.endswith("int8"):  # values outside the calibration range clip to the end buckets
        wide = quantize(vectors * 10, precision, ranges)
        np.testing.assert_array_equal(wide, quantize_embeddings(vectors * 10, precision, ranges=ranges))
        assert {int(wide.min()), int(wide.max())} == ({-128, 127} if precision == "int8" else {0, 255})


@pytest.mark.parametrize("dimensions", [None, 100])
def test_openai_route_quantised_formats_match_sentence_transformers(server, dimensions):
    floats = floats_of(server, TEXTS, dimensions)
    info = published_ranges(server, dimensions=dimensions)
    assert info["dimensions"] == floats.shape[1] and info["calibration"] == f"builtin:{len(CALIBRATION_TEXTS)} texts"
    ranges = np.array(info["ranges"])
    assert ranges.shape == (2, floats.shape[1]) and (ranges[0] < ranges[1]).all()
    with server.client() as c:
        for precision, dtype in DTYPES.items():
            expected = quantize_embeddings(floats, precision, ranges=ranges)
            body = {"model": MODEL, "input": TEXTS, "dimensions": dimensions}
            plain = c.post("/v1/embeddings", json={**body, "encoding_format": precision}).raise_for_status().json()
            got = np.array([d["embedding"] for d in plain["data"]], dtype=dtype)
            np.testing.assert_array_equal(got, expected, err_msg=precision)
            packed = c.post("/v1/embeddings", json={**body, "encoding_format": f"{precision}_base64"}).json()
            got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=dtype) for d in packed["data"]])
            np.testing.assert_array_equal(got, expected, err_msg=f"{precision}_base64")
    width = floats.shape[1]
    assert expected.shape == (len(TEXTS), (width + 7) // 8)


def test_cohere_embed_all_types_in_one_call(server):
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    body = {"model": MODEL, "texts": TEXTS, "input_type": "search_document", "embedding_types": types,
            "output_dimension": 128}
    out = server.client().post("/v2/embed", json=body).raise_for_status().json()
    assert out["texts"] == TEXTS and set(out["embeddings"]) == set(types)
    floats = np.array(out["embeddings"]["float"], dtype=np.float32)
    assert floats.shape == (len(TEXTS), 128)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1, atol=1e-5)
    b64 = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in out["embeddings"]["base64"]])
    np.testing.assert_array_equal(b64, floats)
    ranges = np.array(published_ranges(server, dimensions=128)["ranges"])
    for precision, dtype in DTYPES.items():
        got = np.array(out["embeddings"][precision], dtype=dtype)
        np.testing.assert_array_equal(got, quantize_embeddings(floats, precision, ranges=ranges), err_msg=precision)
    assert out["meta"]["billed_units"]["input_tokens"] > 0


def test_bad_quantisation_requests(server):
    with server.client() as c:
        r = c.post("/v1/embeddings", json={"input": "x", "encoding_format": "int4"})
        assert r.status_code == 422 and "encoding_format" in r.json()["error"]["message"]
        r = c.get(f"/v1/models/{MODEL}/quantization", params={"dimensions": 999})
        assert r.status_code == 422 and "999" in r.json()["error"]["message"]
        r = c.get("/v1/models/not-served/quantization")
        assert r.status_code == 404 and "not-served" in r.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"input": "x", "encoding_format": "uint8"}).status_code == 200


def test_calibration_file_in_model_directory(tmp_path, runtime_factory):
    """`calibration_embeddings.npy` beside the weights replaces the shipped texts as the range source."""
    torch.manual_seed(0)
    d = tmp_path / "tiny-embed"
    d.mkdir()
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(d)
    bert_tokenizer(d)
    sentence_transformers_files(d, "cls", 32)
    rows = np.random.default_rng(3).normal(size=(50, 32)).astype(np.float32)
    np.save(d / "calibration_embeddings.npy", rows)
    srv = runtime_factory("--model", f"tiny={d}")
    info = published_ranges(srv, "tiny", dimensions=16)
    assert info["calibration"] == "file:calibration_embeddings.npy" and info["calibration_size"] == 50
    unit = rows[:, :16] / np.linalg.norm(rows[:, :16], axis=1, keepdims=True)
    np.testing.assert_array_equal(np.array(info["ranges"], dtype=np.float32), np.vstack((unit.min(0), unit.max(0))))
    body = {"model": "tiny", "input": TEXTS, "dimensions": 16}
    floats = np.array(srv.client().post("/v1/embeddings", json=body).json()["data"][0]["embedding"], np.float32)
    got = srv.client().post("/v1/embeddings", json={**body, "encoding_format": "uint8"}).json()["data"][0]
    np.testing.assert_array_equal(np.array(got["embedding"], np.uint8),
                                  quantize_embeddings(floats[None], "uint8", ranges=np.array(info["ranges"]))[0])
