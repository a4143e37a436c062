"""`embedfleet serve --model-digest`: the runtime checks a cache entry against its digest before loading
it, as a real server process on a tiny random BERT pulled through `embedfleet cache pull`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from embedfleet.operator.cache.digest import tree_digest
from embedfleet.runtime.cli import main as embedfleet
from tests.procs import RuntimeServer
from tests.tiny_models import bert_tokenizer, sentence_transformers_files


@pytest.fixture(scope="module")
def entry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny BERT pulled into a pod cache as the init container does: (entry directory, digest)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("src") / "bert"
    src.mkdir()
    BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(src)
    bert_tokenizer(src)
    sentence_transformers_files(src, "cls", 32)
    digest = tree_digest(src)
    cache = tmp_path_factory.mktemp("cache")
    assert embedfleet(["cache", "pull", "--source", f"file://{src}", "--digest", digest,
                       "--cache-dir", str(cache)]) == 0
    return cache / f"sha256-{digest[7:]}", digest


def _exit_of(srv: RuntimeServer, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while srv.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.proc.poll() is not None, f"the server kept running:\n{srv.log()[-2000:]}"
    return srv.proc.returncode


def test_a_verified_entry_is_served(runtime_factory, entry: tuple[Path, str]) -> None:
    path, digest = entry
    srv = runtime_factory("--model", str(path), "--model-digest", digest)
    with srv.client() as client:
        response = client.post("/v1/embeddings", json={"input": ["hello world"], "model": path.name})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"][0]["embedding"]) == 32
    assert "verified against" in srv.log()


def test_a_wrong_digest_or_a_tampered_file_stops_start_up(runtime_factory, entry: tuple[Path, str],
                                                          tmp_path: Path) -> None:
    path, digest = entry
    other = "sha256:" + "0" * 64
    srv = runtime_factory("--model", str(path), "--model-digest", other, wait_ready=False)
    assert _exit_of(srv) == 1
    assert "refusing to load the model" in srv.log() and "not the expected" in srv.log()

    weights = path / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 0x01]))  # one bit, after verification
        srv = runtime_factory("--model", str(path), "--model-digest", digest, wait_ready=False)
        assert _exit_of(srv) == 1
        log = srv.log()
        assert "refusing to load the model" in log and "model.safetensors" in log
        assert "does not match the manifest" in log
    finally:
        weights.write_bytes(original)


def test_the_digest_names_one_model(runtime_factory, entry: tuple[Path, str]) -> None:
    path, digest = entry
    srv = runtime_factory("--model", f"a={path}", "--model", f"b={path}", "--model-digest", digest,
                          wait_ready=False)
    assert _exit_of(srv) == 2
    assert "model_digest" in srv.log()
