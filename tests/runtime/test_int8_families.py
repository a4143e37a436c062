"""`--dtype int8` across the encoder families the runtime serves: RoBERTa and XLM-R embedders are converted,
quantised and judged by the gate (a real OpenVINO/NNCF build of tiny random models, with the cosine it
measured); MPNet and families int8 was never verified on are refused at start-up with the family named, in
process and by a real server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from embedfleet.runtime.engines.int8_cpu import INT8_FAMILIES, Int8CpuEngine, Int8Rejected, build_int8_engine, refusal
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from tests.tiny_models import encoder_family_embedder

pytest.importorskip("openvino")
pytest.importorskip("nncf")


@pytest.mark.parametrize(("family", "seed"), [("roberta", 0), ("xlm-roberta", 1)])
def test_roberta_and_xlmr_embedders_are_built_and_judged(family: str, seed: int, tmp_path: Path) -> None:
    spec = load_spec(encoder_family_embedder(tmp_path, family, seed))
    assert spec.model_type == family and refusal(spec, "cpu") is None
    engine = build_int8_engine(spec, num_threads=2, cache_root=tmp_path / "engines")
    assert isinstance(engine, Int8CpuEngine), "the gate accepted it, so int8 serves it"
    gate = engine.int8_gate
    assert gate is not None and gate.passed and gate.min_cosine >= 0.99, gate
    # pad id 0 and ids past the special tokens: a batch with padding embeds like its rows alone
    rows = engine.embed([[1, 40, 41, 42, 2], [1, 50, 2]])
    alone = engine.embed([[1, 50, 2]])
    assert rows.shape == (2, 32)
    assert float(abs(rows[1] - alone[0]).max()) < 1e-3


def test_mpnet_is_refused_at_start_up_by_family(tmp_path: Path) -> None:
    spec = load_spec(encoder_family_embedder(tmp_path, "mpnet"))
    why = refusal(spec, "cpu")
    assert why is not None and "MPNet family (mpnet)" in why and "serves the BERT, RoBERTa, XLM-R" in why
    with pytest.raises(Int8Rejected, match="MPNet family"):
        build_int8_engine(spec, num_threads=2, cache_root=tmp_path / "engines")
    assert not (tmp_path / "engines").exists(), "refused before anything is built"


def test_an_unverified_family_is_refused_by_its_name() -> None:
    spec = dataclasses.replace(load_spec(default_model_dir()), model_type="distilbert")
    assert "distilbert family (distilbert)" in (refusal(spec, "cpu") or "")
    assert set(INT8_FAMILIES) == {"bert", "roberta", "xlm-roberta"}


def test_a_real_server_names_the_family_it_refuses(tmp_path: Path, runtime_factory) -> None:
    path = encoder_family_embedder(tmp_path, "mpnet")
    srv = runtime_factory("--model", str(path), "--dtype", "int8", "--engine-cache-dir", str(tmp_path / "engines"),
                          wait_ready=False)
    assert srv.proc.wait(timeout=120) != 0
    log = srv.log()
    assert "MPNet family (mpnet)" in log and "--dtype float32" in log
