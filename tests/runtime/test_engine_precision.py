"""bf16 on CPU against fp32, in process: the trade-off the --dtype flag offers; and `serve --dtype
bfloat16` as a real process on this machine (which may fault on AMX: engines/cpu_isa.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.engines import torch_engine
from embedfleet.runtime.engines.cpu_isa import ISA_ENV, IsaDecision, ensure_cpu_bf16
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from tests.procs import child_env
from tests.runtime.test_embeddings_correct import TEXTS

# Loaded by every Python process whose PYTHONPATH starts with its folder: a CPU that faults on bf16
# matmuls, as this machine kind's AMX does, unless oneDNN is capped ("amx"), or always ("bf16").
FAULTY_CPU = f"""
import os
if os.environ.get("FAKE_CPU_FAULT"):
    import signal
    import torch
    _linear = torch.nn.functional.linear

    def linear(input, weight, bias=None):
        capped = os.environ.get("{ISA_ENV}") == "AVX512_CORE_BF16" and os.environ["FAKE_CPU_FAULT"] == "amx"
        if input.dtype == torch.bfloat16 and not capped:
            os.kill(os.getpid(), signal.SIGILL)
        return _linear(input, weight, bias)

    torch.nn.functional.linear = linear
"""


@pytest.mark.usefixtures("cpu_bf16")
def test_bfloat16_matches_float32():
    spec = load_spec(default_model_dir())
    pool = TokenizerPool(spec.path / "tokenizer.json", 1)
    batch = [t.ids for t in pool._encode_sync(TEXTS, spec.max_length, True, "right")]
    threads = torch.get_num_threads()
    fp32 = TorchEngine(spec, dtype="float32").embed(batch)
    bf16 = TorchEngine(spec, dtype="bfloat16").embed(batch)
    torch.set_num_threads(threads)
    a = fp32 / np.linalg.norm(fp32, axis=1, keepdims=True)
    b = bf16 / np.linalg.norm(bf16, axis=1, keepdims=True)
    cosine = (a * b).sum(axis=1)
    print(f"bf16 vs fp32 cosine: min {cosine.min():.6f} mean {cosine.mean():.6f}")
    assert bf16.dtype == np.float32
    assert cosine.min() >= 0.999


def test_bfloat16_where_it_crashes_serves_float32(monkeypatch):
    said = "bfloat16 on CPU: a probe crashed (...); serving float32 instead"
    monkeypatch.setattr(torch_engine, "ensure_cpu_bf16", lambda: IsaDecision(False, message=said))
    for dtype in ("bfloat16", "fp8"):
        engine = TorchEngine(load_spec(default_model_dir()), dtype=dtype)
        assert engine.effective_dtype == "float32" and engine.fp8_gate is None
        assert next(engine.model.parameters()).dtype == torch.float32


def test_serve_bfloat16_answers_on_this_machine(runtime_factory):
    """The server probes bf16 itself: ONEDNN_MAX_CPU_ISA is removed from its environment, so on a CPU
    that faults on AMX it must cap the ISA (or fall back) on its own rather than die by SIGILL."""
    srv = runtime_factory("--dtype", "bfloat16", env={ISA_ENV: None})
    with srv.client() as c:
        reply = c.post("/v1/embeddings", json={"input": ["A cat sits on the mat.", "Kittens play."]})
        card = c.get("/v1/models").json()["data"][0]
    assert reply.status_code == 200, reply.text
    vectors = np.array([row["embedding"] for row in reply.json()["data"]])
    assert vectors.shape == (2, 384) and np.isfinite(vectors).all()
    here = ensure_cpu_bf16()  # what the same probe decided for this test process
    assert card["dtype"] == ("bfloat16" if here.bf16 else "float32")
    if here.cap:
        assert f"capping {ISA_ENV}={here.cap}" in srv.log()


@pytest.mark.parametrize(("fault", "served"), [("amx", "bfloat16"), ("bf16", "float32")])
def test_serve_bfloat16_on_a_cpu_that_faults(runtime_factory, tmp_path, fault, served):
    (tmp_path / "sitecustomize.py").write_text(FAULTY_CPU)
    pythonpath = f"{tmp_path}{os.pathsep}{child_env()['PYTHONPATH']}"
    srv = runtime_factory("--dtype", "bfloat16",
                          env={"PYTHONPATH": pythonpath, "FAKE_CPU_FAULT": fault, ISA_ENV: None})
    with srv.client() as c:
        reply = c.post("/v1/embeddings", json={"input": ["A cat sits on the mat."]})
        card = c.get("/v1/models").json()["data"][0]
    assert reply.status_code == 200, reply.text
    assert card["dtype"] == served and card.get("requested_dtype") == ("bfloat16" if served == "float32" else None)
    warning = [line for line in srv.log().splitlines() if "WARNING" in line and "bfloat16 on CPU" in line]
    assert len(warning) == 1 and "SIGILL" in warning[0], srv.log()[-3000:]
    assert (f"capping {ISA_ENV}=AVX512_CORE_BF16" if fault == "amx" else "serving float32 instead") in warning[0]


def test_the_engine_protocol_is_the_whole_contract():
    """service.py reads nothing of an engine but the Protocol's members, so every engine has each one
    (a member read through getattr with a default once hid an engine that lacked it)."""
    from embedfleet.runtime.engines import base, trtllm_engine

    members = {name for name in vars(base.Engine) if not name.startswith("_")} | set(base.Engine.__annotations__)
    assert {"capabilities", "effective_dtype", "fp8_gate", "warmup", "embed", "classify"} <= members
    engine = TorchEngine(load_spec(default_model_dir()), dtype="float32")
    for name in members:
        assert hasattr(engine, name), name
    assert engine.fp8_gate is None and engine.effective_dtype == "float32"
    source = Path(trtllm_engine.__file__).read_text()  # it cannot be built without a GPU: its source, then
    for name in ("effective_dtype", "fp8_gate"):
        assert f"self.{name} =" in source, name
    assert "def warmup(self)" in source and "getattr(self.engine" not in Path(base.__file__).parent.parent.joinpath(
        "service.py").read_text()
