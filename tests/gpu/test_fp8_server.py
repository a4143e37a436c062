"""`embedfleet serve --dtype fp8` end to end on CPU (FP8 emulated): the gate accepts, falls back, or refuses,
and says so in the log, in /v1/models and in /metrics."""

from __future__ import annotations

import re

import numpy as np
import pytest

from embedfleet.runtime.engines.quality_gate import FP8_MARGIN_FACTOR, required_min_cosine

TEXTS = ["how do I reset my password", "FP8 keeps the ranking", "a longer passage about embeddings " * 5]


def _embed(srv, texts):
    with srv.client() as c:
        r = c.post("/v1/embeddings", json={"input": texts})
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]])


def _card(srv) -> dict:
    with srv.client() as c:
        return c.get("/v1/models").json()["data"][0]


def test_fp8_accepted_is_served_and_reported(runtime_factory, tiny):
    fp8 = runtime_factory("--model", str(tiny["bert-embed"]), "--dtype", "fp8")
    card = _card(fp8)
    assert card["dtype"] == "fp8" and card["requested_dtype"] is None
    # the bound it had to reach is the threshold less the margin, and the figure shown is the one it judged
    assert card["fp8_required_cosine"] == pytest.approx(required_min_cosine(0.999, FP8_MARGIN_FACTOR))
    assert card["fp8_min_cosine"] >= card["fp8_required_cosine"] > 0.999
    judged = re.search(r"fp8 accepted for embed: min cosine ([0-9.]+)", fp8.log())
    assert judged and card["fp8_min_cosine"] == pytest.approx(float(judged.group(1)), abs=1e-6)
    assert fp8.metric("embedfleet_fp8_min_cosine", model="bert-embed") == pytest.approx(card["fp8_min_cosine"])
    assert fp8.metric("embedfleet_fp8_accepted", model="bert-embed") == 1
    assert "fp8 accepted for embed" in fp8.log()

    bf16 = runtime_factory("--model", str(tiny["bert-embed"]), "--dtype", "bfloat16")
    a, b = _embed(fp8, TEXTS), _embed(bf16, TEXTS)
    cos = (a * b).sum(axis=1)  # the served vectors are normalised
    assert cos.min() >= 0.999 and not np.array_equal(a, b)
    assert _card(bf16)["fp8_min_cosine"] is None and _card(bf16)["fp8_required_cosine"] is None
    with pytest.raises(KeyError):
        bf16.metric("embedfleet_fp8_min_cosine")


def test_fp8_refused_by_the_gate_falls_back_to_bf16(runtime_factory, tiny):
    srv = runtime_factory("--model", str(tiny["bert-embed"]), "--dtype", "fp8", "--fp8-min-cosine", "1.0")
    card = _card(srv)
    assert card["dtype"] == "bfloat16" and card["requested_dtype"] == "fp8"
    assert card["fp8_min_cosine"] < card["fp8_required_cosine"] == 1.0
    assert srv.metric("embedfleet_fp8_accepted", model="bert-embed") == 0
    log = srv.log()
    assert "fp8 refused for embed" in log and "falling back to bfloat16" in log
    assert _embed(srv, TEXTS).shape == (3, 32)


def test_fp8_strict_refuses_to_start(runtime_factory, tiny):
    srv = runtime_factory("--model", str(tiny["bert-embed"]), "--dtype", "fp8", "--fp8-min-cosine", "1.0",
                          "--fp8-strict", wait_ready=False)
    assert srv.proc.wait(120) == 1
    log = srv.log()
    assert "Fp8Rejected" in log and "--fp8-strict is set" in log and "min cosine" in log


def test_fp8_reranker_serves_same_ranking(runtime_factory, tiny):
    srv = runtime_factory("--model", str(tiny["bert-rerank"]), "--dtype", "fp8", "--fp8-activation-scaling", "tensor")
    card = _card(srv)
    assert card["dtype"] == "fp8" and card["fp8_required_cosine"] is None  # judged on order, not a bound
    assert "every query's document ranking unchanged" in srv.log()
    with srv.client() as c:
        r = c.post("/rerank", json={"query": "capital of Australia", "texts": ["Canberra", "Sydney", "Paris"]})
        assert r.status_code == 200 and len(r.json()) == 3


def test_bad_gpu_settings_are_refused_by_name(runtime_factory):
    srv = runtime_factory("--fp8-min-cosine", "1.5", wait_ready=False)
    assert srv.proc.wait(60) == 2 and "fp8_min_cosine" in srv.log()
    srv = runtime_factory("--cuda-graphs", wait_ready=False)
    assert srv.proc.wait(60) == 2 and "cuda_graphs: needs device cuda" in srv.log()
