"""engines/bert_native.py: the runtime's own BERT modules give transformers' outputs on the same weights,
serve only what they cover (anything else loads through transformers), refuse a checkpoint that does not
fit them rather than serving random weights, and a CPU start with them never imports transformers' model
code (the point of having them)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from embedfleet.runtime.core.tokenize import TokenizerPool
from embedfleet.runtime.engines import bert_native
from embedfleet.runtime.engines.torch_engine import TorchEngine, repeated_layers
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from tests.tiny_models import bert_classifier, bert_reranker, build_all

TEXTS = ["hello world", "a much longer sentence about the weather in Paris and the rest of France " * 4, "x",
         "Ünïcödé テスト 🚀", ""]
PAIRS = [("what is the capital of france", "Paris is the capital of France."), ("q", "an unrelated document"),
         ("a longer query about several things at once", "d")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-native")
    out = build_all(root)
    out["spread-rerank"] = bert_reranker(root / "spread-rerank")
    out["spread-classify"] = bert_classifier(root / "spread-classify")
    return out


def batch_for(spec, items):
    pool = TokenizerPool(spec.path / "tokenizer.json", 1)
    if spec.task == "embed":
        return pool._encode_sync(items, spec.max_length, True, "right")
    return pool._encode_pairs_sync(items, spec.max_length, True, "right")


@pytest.mark.parametrize("name", ["default", "bert-embed", "bert-rerank", "bert-classify", "spread-rerank",
                                  "spread-classify"])
def test_native_outputs_are_transformers_outputs(tiny, name):
    spec = load_spec(default_model_dir() if name == "default" else tiny[name])
    native, reference = TorchEngine(spec), TorchEngine(spec, native=False)
    assert (native.implementation, reference.implementation) == ("native", "transformers")
    items = TEXTS if spec.task == "embed" else PAIRS
    batch = batch_for(spec, items)
    for rows in (batch, batch[:1], [batch[1]] * 3):  # padded, single, equal lengths (no mask at all)
        got, want = native.runner()(rows), reference.runner()(rows)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_bfloat16_matches_transformers_in_bfloat16(cpu_bf16):
    """The modules' maths, in bf16: the padded path, which sums in transformers' order. The packed path
    (engines/packed_cpu.py) pools in float32 and projects q, k and v in one product, so its bf16 rounding
    differs from transformers' by about as much as either differs from float32; it is held to the bf16
    promise against float32 (tests/runtime/test_engine_precision.py, tests/runtime/test_packed_cpu.py)."""
    spec = load_spec(default_model_dir())
    native = TorchEngine(spec, dtype="bfloat16", packed=False)
    reference = TorchEngine(spec, dtype="bfloat16", native=False)
    assert native.implementation == "native" and native.effective_dtype == "bfloat16"
    batch = batch_for(spec, TEXTS)
    np.testing.assert_allclose(native.embed(batch), reference.embed(batch), rtol=0, atol=1e-2)


def test_the_layer_stack_is_found_for_preemption():
    engine = TorchEngine(load_spec(default_model_dir()))
    assert engine.implementation == "native" and engine.preemptible
    assert len(repeated_layers(engine.model)) == 6
    calls = []
    assert engine.between_layers(lambda: calls.append(1)) == 6
    engine.embed(batch_for(engine.spec, ["one query"]))
    assert len(calls) == 5  # before every layer but the first


def test_the_packed_path_runs_the_native_modules():
    """engines/packed.py reads transformers' module names; the native modules carry them, so a packed
    forward over them gives the padded answer."""
    from embedfleet.runtime.engines.packed import PackedEncoder

    engine = TorchEngine(load_spec(default_model_dir()), packed=False)
    batch = batch_for(engine.spec, TEXTS)
    with torch.inference_mode():
        packed = PackedEncoder(engine.model, "bert", engine.spec.pooling, torch.device("cpu")).embed(batch).numpy()
    np.testing.assert_allclose(packed, engine.embed(batch), rtol=0, atol=2e-5)


def test_what_it_does_not_cover_loads_through_transformers(tiny):
    assert TorchEngine(load_spec(tiny["llama-embed"])).implementation == "transformers"  # another family
    spec = load_spec(default_model_dir())
    assert TorchEngine(spec, native=False).implementation == "transformers"  # --model-impl transformers
    assert bert_native.unsupported(spec, "cuda", torch.bfloat16) is not None  # CUDA keeps the packed path
    assert bert_native.unsupported(spec, "cpu", torch.float16) is not None
    assert bert_native.unsupported(spec, "cpu", torch.float32) is None


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_checkpoint_that_does_not_fit_is_never_served_with_random_weights(tiny, tmp_path):
    """A tensor missing, or of another shape than config.json says: the native load refuses (and the
    engine falls back to transformers, which reports it its own way), never leaves a parameter at its
    random initialisation."""
    src = tiny["bert-embed"]
    missing = copy_model(src, tmp_path / "missing")
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["encoder.layer.1.output.dense.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(bert_native.NativeLoadError, match=re.escape("encoder.layer.1.output.dense.weight")):
        bert_native.load(load_spec(missing), torch.float32)

    reshaped = copy_model(src, tmp_path / "reshaped")
    config = json.loads((reshaped / "config.json").read_text())
    config["intermediate_size"] += 1
    (reshaped / "config.json").write_text(json.dumps(config))
    with pytest.raises(bert_native.NativeLoadError, match=re.escape("intermediate.dense.weight")):
        bert_native.load(load_spec(reshaped), torch.float32)

    integers = copy_model(src, tmp_path / "integers")
    tensors = load_file(str(integers / "model.safetensors"))
    tensors["embeddings.LayerNorm.weight"] = tensors["embeddings.LayerNorm.weight"].to(torch.int64)
    save_file(tensors, str(integers / "model.safetensors"))
    with pytest.raises(bert_native.NativeLoadError, match="not a floating-point tensor"):
        bert_native.load(load_spec(integers), torch.float32)


def test_a_config_naming_enormous_sizes_allocates_nothing(tiny, tmp_path):
    """config.json is as writable as the weights: sizes far beyond the file's tensors are refused on the
    shapes (the modules are built on the meta device), not allocated first (this one would be ~4 TB)."""
    huge = copy_model(tiny["bert-embed"], tmp_path / "huge")
    config = json.loads((huge / "config.json").read_text())
    config.update(vocab_size=1_000_000, hidden_size=1_000_000, num_attention_heads=1)
    (huge / "config.json").write_text(json.dumps(config))
    with pytest.raises(bert_native.NativeLoadError, match="the config says"):
        bert_native.load(load_spec(huge), torch.float32)

    deep = copy_model(tiny["bert-embed"], tmp_path / "deep")
    config = json.loads((deep / "config.json").read_text())
    config["num_hidden_layers"] = 10**9  # a billion layers' modules would exhaust memory before any shape check
    (deep / "config.json").write_text(json.dumps(config))
    with pytest.raises(bert_native.NativeLoadError, match="says 1000000000 layers"):
        bert_native.load(load_spec(deep), torch.float32)


@pytest.mark.parametrize("field,value,why", [
    ("num_attention_heads", 0, "num_attention_heads under 1"),
    ("intermediate_size", -4, "intermediate_size under 1"),
    ("layer_norm_eps", float("nan"), "layer_norm_eps nan"),
])
def test_a_config_with_impossible_values_falls_back_with_its_reason(tiny, tmp_path, field, value, why):
    """Zero heads would divide by zero and a negative size fail deep in torch: the native check names the
    field instead, and the engine loads the model through transformers (which judges the file itself)."""
    bad = copy_model(tiny["bert-embed"], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config[field] = value
    (bad / "config.json").write_text(json.dumps(config))
    shape, reason = bert_native.check(load_spec(bad), "cpu", torch.float32)
    assert shape is None and reason is not None and why in reason, reason


def test_a_cpu_start_never_imports_transformers_model_code_nor_torch_dynamo():
    """What the native modules are for: the engine built and warmed up as `embedfleet serve` does it, in a
    fresh interpreter, with no transformers module imported (its model code was most of a start's CPU) and
    no torch._dynamo (initialising parameters on the meta device imported it: about 2 s of a start)."""
    code = ("import sys\n"
            "from embedfleet.runtime.settings import RuntimeSettings\n"
            "from embedfleet.runtime.service import build_engine\n"
            "from embedfleet.runtime.models.spec import load_spec\n"
            "s = RuntimeSettings(); e = s.models()[0]\n"
            "engine = build_engine(s, load_spec(e.path, e.name, e.task)); engine.warmup()\n"
            "print(engine.implementation, sorted(m for m in sys.modules if m.startswith('transformers')),\n"
            "      'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[0] == "native [] False", out.stdout + out.stderr
