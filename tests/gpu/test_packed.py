"""Packed sequences (engines/packed.py) and GPU batch sizing (engines/gpu_batching.py).

On CPU: the packed forward (attention one sequence at a time) against transformers' padded forward on
the real all-MiniLM-L6-v2 and on tiny BERT/RoBERTa models for every pooling; the host layout of a
packed batch and of a CUDA graph's bucket; the sizing functions' properties. On a GPU: the packed
engine (variable-length FlashAttention, CUDA graphs of small batches) against the fp32 CPU reference.
"""

from __future__ import annotations

import json
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.engines import gpu_batching
from embedfleet.runtime.engines.packed import PackedEncoder, pack_host, packed_unsupported
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir
from tests.gpu.conftest import requires_cuda
from tests.tiny_models import bert_tokenizer, sentence_transformers_files

CPU = torch.device("cpu")


def _batch(rng: np.random.Generator, lengths, cls: int = 101, sep: int = 102) -> list[list[int]]:
    return [[cls, *rng.integers(1000, 20000, n).tolist(), sep] for n in lengths]


@pytest.fixture(scope="module")
def minilm() -> TorchEngine:
    # transformers' modules, as the packed path runs them on CUDA (on CPU the engine would serve its own)
    return TorchEngine(load_spec(default_model_dir()), native=False)


def test_packed_forward_matches_padded_transformers_on_minilm(minilm):
    batch = _batch(np.random.default_rng(0), (3, 17, 64, 1, 200, 5))
    reference = minilm.embed(batch)
    enc = PackedEncoder(minilm.model, "bert", minilm.spec.pooling, CPU)
    with torch.inference_mode():
        got = enc.embed(batch).numpy()
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, atol=2e-5)


def test_a_graph_bucket_holds_the_same_rows(minilm):
    """The bucketed layout (spare tokens as an extra segment) pools the real rows exactly as the tight one."""
    batch = _batch(np.random.default_rng(1), (10, 30, 2))
    enc = PackedEncoder(minilm.model, "bert", minilm.spec.pooling, CPU)
    with torch.inference_mode():
        tight = enc.embed(batch)
        b = enc.stage(batch, 128, 5)
        bucketed = enc.pool(enc.hidden(b), b)[: len(batch)]
    torch.testing.assert_close(bucketed, tight, atol=2e-5, rtol=0)


def _tiny(tmp_path, kind: str, pooling: str):
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    torch.manual_seed(3)
    small = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64}
    d = tmp_path / f"{kind}-{pooling}"
    d.mkdir()
    if kind == "roberta":
        RobertaModel(RobertaConfig(**small, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1)
                     ).save_pretrained(d)
    else:
        BertModel(BertConfig(**small, max_position_embeddings=128)).save_pretrained(d)
    bert_tokenizer(d)
    sentence_transformers_files(d, pooling, 32)
    if pooling == "max":
        cfg = d / "1_Pooling" / "config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "pooling_mode_max_tokens": True}))
    return TorchEngine(load_spec(d))


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "last"])
def test_every_pooling_and_position_scheme_matches(tmp_path, kind, pooling):
    """RoBERTa's positions start after its padding index; each pooling reads its segment only."""
    engine = _tiny(tmp_path, kind, pooling)
    batch = _batch(np.random.default_rng(2), (1, 9, 40, 3, 100), cls=0 if kind == "roberta" else 101,
                   sep=2 if kind == "roberta" else 102)
    reference = engine.embed(batch)
    enc = PackedEncoder(engine.model, kind, pooling, CPU)
    with torch.inference_mode():
        got = enc.embed(batch).numpy()
    np.testing.assert_allclose(got, reference, atol=1e-5)


def test_pair_inputs_keep_their_segment_ids(minilm):
    class Pair:
        def __init__(self, ids, type_ids):
            self.ids, self.type_ids = ids, type_ids

        def __len__(self):
            return len(self.ids)

    rng = np.random.default_rng(4)
    a, b = _batch(rng, (5, 12))
    pairs = [Pair(a + b[1:], [0] * len(a) + [1] * (len(b) - 1)), Pair(b, [0] * len(b))]
    reference = minilm.embed(pairs)
    enc = PackedEncoder(minilm.model, "bert", minilm.spec.pooling, CPU)
    with torch.inference_mode():
        np.testing.assert_allclose(enc.embed(pairs).numpy(), reference, atol=2e-5)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_host_layout(lengths, offset):
    batch = [list(range(100, 100 + n)) for n in lengths]
    total = sum(lengths)
    arr, tokens, segments, longest = pack_host(batch, offset)
    assert (tokens, segments) == (total, len(lengths)) and longest >= max(lengths) and longest % 64 == 0
    ids, pos, seg = arr[:tokens], arr[tokens:2 * tokens], arr[3 * tokens:4 * tokens]
    cu = arr[4 * tokens:4 * tokens + segments + 1]
    assert ids.tolist() == [t for s in batch for t in s]
    assert cu.tolist() == [0, *np.cumsum(lengths).tolist()]
    for i, (lo, hi) in enumerate(pairwise(cu)):
        assert pos[lo:hi].tolist() == list(range(offset, offset + hi - lo))
        assert set(seg[lo:hi].tolist()) == {i}
    # a bucket: real segments unchanged, spare ones non-empty, positions of spare tokens valid
    spare_rows = 2
    bucket = total + spare_rows + 5
    arr, tokens, segments, _ = pack_host(batch, offset, bucket, len(lengths) + spare_rows)
    cu = arr[4 * tokens:4 * tokens + segments + 1]
    assert tokens == bucket and cu[-1] == bucket and cu[: len(lengths) + 1].tolist()[-1] == total
    assert (np.diff(cu) >= 1).all()
    assert arr[tokens:2 * tokens].max() < offset + max(max(lengths), 1)
    with pytest.raises(ValueError):
        pack_host(batch, offset, total, len(lengths) + 1)  # no room for the spare segment


def test_where_packing_does_not_apply(minilm, tiny):
    model = minilm.model
    assert packed_unsupported(model, "bert", "embed", CPU, torch.float32) is None
    assert "classify" in packed_unsupported(model, "bert", "classify", CPU, torch.float32)
    assert "llama" in packed_unsupported(model, "llama", "embed", CPU, torch.float32)
    assert "bfloat16" in packed_unsupported(model, "bert", "embed", torch.device("cuda"), torch.float32)


# -- sizing ---------------------------------------------------------------------------------------
CONFIG = {"hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096,
          "max_position_embeddings": 512, "hidden_act": "gelu", "model_type": "bert"}


@given(st.integers(0, 200).map(lambda g: g * 2**30 // 4))
@settings(max_examples=50, deadline=None)
def test_the_budget_fits_and_stays_within_bounds(free):
    fits = gpu_batching.largest_fitting_budget(CONFIG, "bfloat16", free)
    if fits == 0:
        with pytest.raises(gpu_batching.MemoryBudgetError, match="no room"):
            gpu_batching.gpu_budget(CONFIG, "bfloat16", free, 512)
        return
    budget = gpu_batching.gpu_budget(CONFIG, "bfloat16", free, 512)
    assert budget <= max(fits, 512) and budget <= gpu_batching.MAX_GPU_BATCH_TOKENS
    if fits >= gpu_batching.MAX_GPU_BATCH_TOKENS:
        assert budget == gpu_batching.MAX_GPU_BATCH_TOKENS
    requests = gpu_batching.gpu_requests(budget)
    assert 1 <= requests <= min(budget, gpu_batching.GPU_REQUESTS[1])


@given(st.floats(1e-4, 0.05), st.floats(1e-7, 1e-5), st.integers(1000, 100_000))
def test_overhead_recovers_a_linear_cost_model(fixed, per_token, tokens):
    """A call costing fixed + per_token x tokens has an overhead of fixed / per_token tokens."""
    small, large = fixed + per_token * 8, fixed + per_token * tokens
    got = gpu_batching.overhead_tokens(small, large, tokens, 8)
    expected = min(gpu_batching.MAX_OVERHEAD_TOKENS, (fixed + 8 * per_token) / per_token)
    assert got == pytest.approx(expected, rel=1e-6, abs=1)


def test_the_users_values_are_kept():
    chosen = gpu_batching.choose({"max_batch_requests": 48}, CONFIG, "bfloat16", 40 * 2**30, 512, overhead=900)
    assert chosen.max_batch_requests == 48 and chosen.chosen_by["max_batch_requests"] == "user"
    assert chosen.max_batch_tokens == gpu_batching.MAX_GPU_BATCH_TOKENS
    assert chosen.batch_overhead_tokens == 900 and chosen.chosen_by["batch_overhead_tokens"] == "device"
    kept = gpu_batching.choose({"batch_overhead_tokens": 10}, CONFIG, "bfloat16", 40 * 2**30, 512, overhead=900)
    assert kept.batch_overhead_tokens == 10


# -- on a GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("graphs", [False, True])
def test_packed_engine_on_gpu_matches_fp32(graphs):
    from tests.gpu.test_on_gpu import _cos

    spec = load_spec(default_model_dir())
    rng = np.random.default_rng(5)
    batches = [_batch(rng, (6,)), _batch(rng, (3, 40)), _batch(rng, rng.integers(1, 250, 300).tolist())]
    reference = TorchEngine(spec)
    engine = TorchEngine(spec, device="cuda", dtype="bfloat16", cuda_graphs=graphs)
    assert engine.packed is not None
    engine.warmup()
    assert bool(engine.graph_shapes) == graphs
    for batch in batches:
        cos = _cos(reference.embed(batch), engine.embed(batch))
        assert cos.min() >= 0.999, cos.min()
