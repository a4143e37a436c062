"""`--dtype int8` on CPU: the OpenVINO int8 build of the embedded default passes the gate, is cached by model
digest (a second start neither loads float32 nor quantises), a gate it fails refuses the start (or serves
float32 when told to), models it cannot judge are refused by name, and a real server reports what it serves.
Rerankers and classifiers: tests/runtime/test_int8_scoring.py; encoder families: test_int8_families.py."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from embedfleet.runtime.engines import int8_cpu
from embedfleet.runtime.engines.int8_cpu import Int8CpuEngine, Int8Rejected, build_int8_engine, refusal
from embedfleet.runtime.engines.quality_gate import calibration_batches, load_calibration, row_cosines
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import ModelSpec, load_spec
from embedfleet.runtime.settings import default_model_dir
from tests.runtime.test_embeddings_correct import TEXTS

pytest.importorskip("openvino")
pytest.importorskip("nncf")

THREADS = 2


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return load_spec(default_model_dir())


@pytest.fixture(scope="module")
def built(spec: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Int8CpuEngine]:
    """One real build (quantise + gate) into a cache folder the module's tests share."""
    root = tmp_path_factory.mktemp("engines")
    engine = build_int8_engine(spec, num_threads=THREADS, cache_root=root)
    assert isinstance(engine, Int8CpuEngine)
    return root, engine


def test_the_embedded_default_passes_the_gate(spec: ModelSpec, built: tuple[Path, Int8CpuEngine]) -> None:
    _, engine = built
    gate = engine.int8_gate
    assert gate is not None and gate.passed and gate.min_cosine >= 0.99, gate
    assert engine.effective_dtype == "int8"
    # texts the gate never saw stay close to float32 too
    fp32 = TorchEngine(spec, dtype="float32", num_threads=THREADS)
    batch = [b for batches in calibration_batches(spec, dataclasses.replace(load_calibration(), texts=TEXTS))
             for b in batches]
    cos = row_cosines(fp32.embed(batch), engine.embed(batch))
    assert cos.min() >= 0.99, cos


def test_a_second_start_reuses_the_cached_build(spec: ModelSpec, built: tuple[Path, Int8CpuEngine],
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """It is judged again on the probe texts against float32 (tests/runtime/test_int8_gate.py), not rebuilt."""
    root, first = built

    def forbidden(*args, **kwargs):
        raise AssertionError("a cached build must not be quantised again")

    monkeypatch.setattr(int8_cpu, "quantize", forbidden)
    with caplog.at_level(logging.INFO, logger="embedfleet.runtime.engines.int8_cpu"):
        again = build_int8_engine(spec, num_threads=THREADS, cache_root=root)
    assert isinstance(again, Int8CpuEngine) and again.int8_gate.passed and first.int8_gate.measured_on == "judge"
    assert again.int8_gate.measured_on == "probe", "the verdict is the probe this start measured, not the stored one"
    assert any("passed its re-judgement" in r.getMessage() for r in caplog.records)
    batch = [[101, 7592, 2088, 102], [101, 2023, 2003, 1037, 3231, 102]]
    np.testing.assert_allclose(again.embed(batch), first.embed(batch), rtol=0, atol=1e-6)


def test_a_failed_gate_refuses_the_start_or_serves_float32(spec: ModelSpec, built: tuple[Path, Int8CpuEngine],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A threshold above what int8 measured on this model: the same verdict as a model int8 damages."""
    root, engine = built
    assert engine.int8_gate is not None
    strict_bar = 1.0
    with pytest.raises(Int8Rejected, match=r"int8 refused for embed: min cosine .* judged input \d+"):
        build_int8_engine(spec, num_threads=THREADS, cache_root=root, min_cosine=strict_bar)
    fallback = build_int8_engine(spec, num_threads=THREADS, cache_root=root, min_cosine=strict_bar, strict=False)
    assert isinstance(fallback, TorchEngine) and fallback.effective_dtype == "float32"
    assert fallback.int8_gate is not None and not fallback.int8_gate.passed
    assert fallback.int8_gate.min_cosine == engine.int8_gate.min_cosine


@pytest.mark.parametrize(("change", "device", "says"), [
    ({"task": "sparse"}, "cpu", "sparse model"),
    ({"task": "multivector"}, "cpu", "multivector model"),
    ({"is_decoder": True, "model_type": "qwen2"}, "cpu", "decoder"),
    ({}, "cuda", "CPU precision"),
])
def test_models_int8_cannot_judge_are_refused_by_name(spec: ModelSpec, change: dict, device: str, says: str) -> None:
    other = dataclasses.replace(spec, **change)
    assert says in (refusal(other, device) or "")
    if device == "cpu":
        with pytest.raises(Int8Rejected, match=says):
            build_int8_engine(other, num_threads=THREADS)
    assert refusal(spec, "cpu") is None


def test_a_real_server_reports_int8_and_its_measured_cosine(built: tuple[Path, Int8CpuEngine], runtime_factory,
                                                            spec: ModelSpec) -> None:
    root, engine = built
    # the build is cached: the server judges it again on the probe texts and reports what it measured there
    probed = build_int8_engine(spec, num_threads=THREADS, cache_root=root).int8_gate
    assert probed is not None and probed.measured_on == "probe"
    srv = runtime_factory("--dtype", "int8", "--engine-cache-dir", str(root))
    with srv.client() as c:
        card = c.get("/v1/models").raise_for_status().json()["data"][0]
        assert card["dtype"] == "int8" and card["requested_dtype"] is None and card["int8_measured_on"] == "probe"
        assert card["int8_min_cosine"] == pytest.approx(probed.min_cosine, abs=1e-5)
        assert card["int8_min_cosine"] >= 0.99
        body = c.post("/v1/embeddings", json={"input": TEXTS[:4]}).raise_for_status().json()
        ((name, startup),) = c.get("/load").raise_for_status().json()["startup"]["models"].items()
    # the build this module made, found in this CPU class's folder (tests/runtime/test_engine_builds.py)
    assert startup["engine"] == {"source": "cache", "path": str(engine.build_source.path)}
    assert srv.metric("embedfleet_engine_source_info", model=name, source="cache") == 1
    served = np.array([d["embedding"] for d in body["data"]])
    fp32 = TorchEngine(spec, dtype="float32", num_threads=THREADS)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.path / "tokenizer.json"))
    tok.no_padding()  # the file pads to a fixed width; the engine pads per batch
    reference = fp32.embed([e.ids for e in tok.encode_batch(TEXTS[:4])])
    assert row_cosines(reference, served).min() >= 0.99


def test_openvino_and_nncf_telemetry_never_loads() -> None:
    """Both send usage to Google Analytics unless told not to; the runtime blocks the telemetry package
    before importing them. Checked in a fresh interpreter: under pytest NNCF stubs itself anyway."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from embedfleet.runtime.engines import int8_cpu\n"
            "int8_cpu.no_telemetry()\n"
            "import nncf, openvino\n"
            "from nncf.telemetry import wrapper\n"
            "import openvino.tools.ovc.telemetry_utils as ovc\n"
            "assert 'pytest' not in sys.modules\n"
            "print(type(wrapper.telemetry).__name__, ovc.tm.__name__, sys.modules['openvino_telemetry'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    nncf_impl, ovc_impl, module = out.stdout.split()
    assert nncf_impl != "NNCFTelemetry" and ovc_impl.endswith("telemetry_stub") and module == "None", out.stdout


@pytest.mark.parametrize(("flags", "implementation", "packed"), [
    ({}, "native", True),
    ({"packed": False}, "native", False),
    ({"model_impl": "transformers"}, "transformers", False),
])
def test_the_float32_serving_a_refused_int8_is_the_one_the_flags_ask_for(
        spec: ModelSpec, built: tuple[Path, Int8CpuEngine], flags: dict, implementation: str, packed: bool) -> None:
    """--no-int8-strict serves float32 where the gate refuses int8: the server's own float32 engine, with its
    --no-packed and --model-impl, not the transformers' modules the build was exported from (which on CPU
    never run packed) nor an engine with the defaults."""
    from embedfleet.runtime.service import build_engine
    from embedfleet.runtime.settings import RuntimeSettings

    root, _ = built
    settings = RuntimeSettings(dtype="int8", int8_strict=False, int8_min_cosine=1.0, engine_cache_dir=root,
                               num_threads=THREADS, **flags)
    engine = build_engine(settings, spec)
    assert isinstance(engine, TorchEngine) and engine.effective_dtype == "float32"
    assert engine.int8_gate is not None and not engine.int8_gate.passed
    assert (engine.implementation, engine.packed is not None) == (implementation, packed)
