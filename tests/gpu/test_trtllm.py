"""TensorRT-LLM engine, CPU side: the missing-package error (in process and from a real server),
cache keys and paths, the build-once logic, pooling of packed hidden states."""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from embedfleet.runtime.engines.cache_dir import default_engine_cache_dir
from embedfleet.runtime.engines.torch_engine import pool
from embedfleet.runtime.engines.trtllm_engine import (
    MANIFEST,
    EngineKey,
    TrtLlmUnavailable,
    engine_path,
    ensure_engine,
    is_built,
    pool_packed,
    require_tensorrt_llm,
)
from embedfleet.runtime.models.spec import load_spec

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
KEY = EngineKey("sha256:" + "ab" * 32, "NVIDIA H100 80GB HBM3", "bfloat16", "1.0.0", 16384, 512, 64)


@pytest.mark.skipif(HAS_TRTLLM, reason="tensorrt_llm is installed here; this checks the error where it is not")
def test_missing_package_error_names_what_to_install():
    with pytest.raises(TrtLlmUnavailable) as err:
        require_tensorrt_llm()
    msg = str(err.value)
    assert "pip install tensorrt_llm" in msg and "runtime/Dockerfile.gpu" in msg and "--engine torch" in msg


@pytest.mark.skipif(HAS_TRTLLM, reason="tensorrt_llm is installed here; this checks the error where it is not")
def test_server_refuses_to_start_without_tensorrt_llm(runtime_factory, tiny):
    srv = runtime_factory("--model", str(tiny["bert-embed"]), "--engine", "trtllm", wait_ready=False)
    assert srv.proc.wait(120) == 1
    log = srv.log()
    assert "model failed to load" in log and "pip install tensorrt_llm" in log and "Dockerfile.gpu" in log


def test_key_changes_with_every_field():
    """Every field, read from the dataclass (a list written by hand here once missed the batch size)."""
    names = {KEY.dirname()}
    for field in fields(EngineKey):
        value = getattr(KEY, field.name)
        changed = value * 2 if isinstance(value, int) else f"{value}-other"
        names.add(replace(KEY, **{field.name: changed}).dirname())
    assert len(names) == len(fields(EngineKey)) + 1
    assert "max_batch_size" in {f.name for f in fields(EngineKey)}


def test_dirname_is_readable_and_filesystem_safe():
    name = KEY.dirname()
    assert name.startswith("nvidia-h100-80gb-hbm3-bfloat16-trtllm1.0.0-")
    assert "/" not in name and " " not in name
    assert replace(KEY, gpu_name="  ").dirname().startswith("gpu-")


def test_engine_path_groups_by_model(tiny, tmp_path):
    spec = load_spec(tiny["bert-embed"])
    key = replace(KEY, model_digest=spec.digest)
    path = engine_path(tmp_path, spec, key)
    assert path.parent.parent == tmp_path
    assert path.parent.name == f"bert-embed-{spec.digest.removeprefix('sha256:')[:16]}"
    assert path.name == key.dirname()


def test_default_cache_dir_beside_the_model_or_user_cache(tmp_path, monkeypatch):
    model = tmp_path / "sha256-abc"
    model.mkdir()
    assert default_engine_cache_dir(model) == tmp_path / "engines"
    read_only = tmp_path / "ro"
    (read_only / "model").mkdir(parents=True)
    read_only.chmod(0o555)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        assert default_engine_cache_dir(read_only / "model") == tmp_path / "xdg" / "embedfleet" / "engines"
    finally:
        read_only.chmod(0o755)


def test_build_once_then_reuse(tmp_path):
    calls = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "rank0.engine").write_bytes(b"engine")

    path = tmp_path / "m" / KEY.dirname()
    assert ensure_engine(path, KEY, build) is True
    assert ensure_engine(path, KEY, build) is False  # restart: reused
    assert len(calls) == 1 and (path / "rank0.engine").read_bytes() == b"engine" and is_built(path, KEY)
    leftovers = [p for p in path.parent.iterdir() if p.is_dir() and p != path]
    assert not leftovers  # no temporary build folder left behind


def test_failed_build_leaves_nothing_and_a_foreign_build_is_replaced(tmp_path):
    path = tmp_path / "m" / KEY.dirname()

    def broken(out: Path) -> None:
        (out / "partial").write_text("x")
        raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError, match="builder crashed"):
        ensure_engine(path, KEY, broken)
    assert not path.exists() and [p.name for p in path.parent.iterdir()] == [f".{path.name}.lock"]

    path.mkdir()
    (path / MANIFEST).write_text('{"key": {"dtype": "float16"}}')  # someone else's engine under our name
    assert not is_built(path, KEY)
    assert ensure_engine(path, KEY, lambda out: (out / "rank0.engine").write_bytes(b"new")) is True
    assert (path / "rank0.engine").read_bytes() == b"new"


def test_concurrent_starts_build_once(tmp_path):
    path = tmp_path / "m" / KEY.dirname()
    built = []
    gate = threading.Barrier(4)

    def build(out: Path) -> None:
        built.append(out)
        (out / "rank0.engine").write_bytes(b"e")

    def start() -> None:
        gate.wait()
        ensure_engine(path, KEY, build)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and is_built(path, KEY)


@pytest.mark.parametrize("how", ["mean", "cls", "last", "max"])
def test_packed_pooling_equals_padded_pooling(how):
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 7, 1, 5])
    hidden = torch.randn(int(lengths.sum()), 8, generator=g)
    padded = torch.zeros(4, 7, 8)
    mask = torch.zeros(4, 7, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lengths.tolist()):
        padded[i, :n] = hidden[start:start + n]
        mask[i, :n] = 1
        start += n
    torch.testing.assert_close(pool_packed(hidden, lengths, how), pool(padded, mask, how))


def test_roberta_family_uses_its_own_classes_and_position_offset():
    """Built with BERT classes and positions from 0, RoBERTa and XLM-R run and give wrong vectors."""
    from embedfleet.runtime.engines.trtllm_engine import model_classes, position_ids

    assert model_classes("bert") == ("BertModel", "BertForSequenceClassification")
    roberta = ("RobertaModel", "RobertaForSequenceClassification")
    assert model_classes("roberta") == model_classes("xlm-roberta") == roberta
    assert position_ids([3, 2], "bert", 0) == [0, 1, 2, 0, 1]
    assert position_ids([3, 2], "xlm-roberta", 1) == [2, 3, 4, 2, 3]  # padding_idx 1: positions from 2
    # the same as transformers computes for unpadded inputs
    import torch
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    ids = torch.tensor([[5, 6, 7]])
    expected = RobertaEmbeddings.create_position_ids_from_input_ids(ids, padding_idx=1).tolist()[0]
    assert expected == position_ids([3], "roberta", 1)
