"""The runtime's own identity of a model folder (`models.spec.directory_digest`): it keys the default vector
space, the Redis vector cache and the int8/TensorRT-LLM engine builds, so different weights must never share
it, even a fine-tune with the same files, sizes and configs, and the same weights must keep it wherever the
node cache put them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.models.spec import SAMPLE_BYTES, WHOLE_FILE_BYTES, directory_digest


def _model(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    (root / "tokenizer.json").write_text("{}")
    (root / "model.safetensors").write_bytes(weights)
    return root


def _big(seed: int) -> bytearray:
    import random

    return bytearray(random.Random(seed).randbytes(WHOLE_FILE_BYTES + 3 * SAMPLE_BYTES + 17))


def test_a_fine_tune_with_the_same_layout_gets_its_own_digest(tmp_path: Path) -> None:
    base = _big(0)
    tuned = bytearray(base)
    for i in range(0, len(tuned), 1 << 16):  # every weight moved a little, as training does
        tuned[i] ^= 1
    a, b = _model(tmp_path / "base", bytes(base)), _model(tmp_path / "tuned", bytes(tuned))
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert directory_digest(a) != directory_digest(b)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2000), st.integers(0, 255))
def test_small_files_count_byte_for_byte(position: int, value: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        weights = bytes(2048)
        changed = bytearray(weights)
        changed[position] = value
        a, b = _model(Path(tmp) / "a", weights), _model(Path(tmp) / "b", bytes(changed))
        assert (directory_digest(a) == directory_digest(b)) == (value == 0)


def test_the_same_weights_keep_their_digest_in_any_folder_with_any_cache_bookkeeping(tmp_path: Path) -> None:
    a = _model(tmp_path / "here", bytes(_big(1)))
    b = tmp_path / "elsewhere" / "ns_sha256-abc"
    shutil.copytree(a, b)
    (b / ".ready").write_text("")
    (b / ".source.json").write_text(json.dumps({"source": "peer", "seconds": 1.25}))
    (b / ".cache" / "huggingface").mkdir(parents=True)
    (b / ".cache" / "huggingface" / "download.lock").write_text("x")
    assert directory_digest(a) == directory_digest(b)


@pytest.mark.parametrize("where", ["first", "last"])
def test_the_first_and_last_bytes_of_large_weights_count(tmp_path: Path, where: str) -> None:
    base = _big(2)
    changed = bytearray(base)
    changed[0 if where == "first" else -1] ^= 0xFF
    assert directory_digest(_model(tmp_path / "a", bytes(base))) != \
        directory_digest(_model(tmp_path / "b", bytes(changed)))
