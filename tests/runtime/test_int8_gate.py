"""The int8 embedder gate judges out of sample, with a margin, and never trusts a stored verdict: the texts a
build is quantised on and the texts it is judged on are disjoint (pure, and spied on in a real build); a
judged minimum exactly at --int8-min-cosine is refused (the margin); a cached build whose `int8.json` was
forged (min cosine 1.0) over bad weights is judged again on the probe texts and built again, never served.
Real OpenVINO/NNCF builds of tiny random RoBERTa embedders (the family test_int8_families.py shows the gate
keeps)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from embedfleet.runtime.engines import int8_cpu
from embedfleet.runtime.engines.int8_cpu import MANIFEST, Int8CpuEngine, Int8Rejected, build_int8_engine
from embedfleet.runtime.engines.quality_gate import load_calibration, row_cosines
from embedfleet.runtime.engines.torch_engine import TorchEngine
from embedfleet.runtime.models.spec import ModelSpec, load_spec
from embedfleet.runtime.settings import default_model_dir
from tests.tiny_models import encoder_family_embedder

pytest.importorskip("openvino")
pytest.importorskip("nncf")

THREADS = 2
BATCH = [[1, 40, 41, 42, 2], [1, 50, 2], [1, *range(60, 120), 2], [1, 7, 8, 9, 10, 11, 2]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelSpec]:
    specs = {}
    for seed in (0, 1):
        root = tmp_path_factory.mktemp(f"tiny-seed{seed}")
        specs[seed] = load_spec(encoder_family_embedder(root, "roberta", seed))
    return specs


@pytest.fixture(scope="module")
def seen() -> dict[str, list[tuple[int, ...]]]:
    """What the seed-0 build (in `builds`) calibrated on and what its gate embedded."""
    return {"quantised": [], "judged": []}


@pytest.fixture(scope="module")
def builds(tiny: dict[str, ModelSpec], tmp_path_factory: pytest.TempPathFactory,
           seen: dict[str, list[tuple[int, ...]]]) -> dict[int, Path]:
    """One good build of each tiny model, each in its own engine cache; tests spoil copies of them. The
    seed-0 build is spied on (`seen`): one build serves both, a real build being most of this file's time."""
    out = {}
    for seed, spec in tiny.items():
        root = tmp_path_factory.mktemp(f"engines-seed{seed}")
        with pytest.MonkeyPatch.context() as patch:
            if seed == 0:
                spy_on_the_build(patch, seen)
            engine = build_int8_engine(spec, num_threads=THREADS, cache_root=root)
        assert isinstance(engine, Int8CpuEngine) and engine.int8_gate.passed
        out[seed] = root
    return out


def spy_on_the_build(patch: pytest.MonkeyPatch, seen: dict[str, list[tuple[int, ...]]]) -> None:
    quantize, embed = int8_cpu.quantize, Int8CpuEngine.embed

    def spy_quantize(fp32, batches, out, *args, **kwargs):
        seen["quantised"].extend(tuple(x) for b in batches for x in b)
        return quantize(fp32, batches, out, *args, **kwargs)

    def spy_embed(self, batch):
        seen["judged"].extend(tuple(x) for x in batch)
        return embed(self, batch)

    patch.setattr(int8_cpu, "quantize", spy_quantize)
    patch.setattr(Int8CpuEngine, "embed", spy_embed)


def copy_cache(root: Path, to: Path) -> Path:
    """A copy of an engine cache, and the one build folder in it."""
    shutil.copytree(root, to)
    (manifest,) = to.rglob(MANIFEST)
    return manifest.parent


# -- pure: the sets and the margin ----------------------------------------------------------------------------
def test_no_text_calibrated_on_is_judged() -> None:
    from embedfleet.runtime.engines.int8_gate import int8_sets, split_texts

    spec = load_spec(default_model_dir())
    sets = int8_sets(spec.path / "tokenizer.json", spec.max_length)
    assert not set(sets.calibrate) & set(sets.judge)
    assert set(sets.probe) <= set(sets.judge) and 4 <= len(sets.probe) < len(sets.judge)
    assert int8_sets(spec.path / "tokenizer.json", spec.max_length) == sets, "the same model, the same sets"
    base = load_calibration().texts
    assert set(base) <= set(sets.calibrate) | set(sets.judge), "calibration.json is split, not dropped"
    for which in (sets.calibrate, sets.judge):  # both halves hold short queries, long passages, degenerate runs
        assert any(len(t.split()) <= 3 for t in which)
        assert any(len(t.split()) >= 200 for t in which)
        assert any(len(t.split()) >= 50 and len(set(t.split())) <= 2 for t in which)
    vocab = [t for t in sets.judge if t not in base and len(set(t.split())) > 50]
    assert vocab and not {w for t in vocab for w in t.split()} <= {w for t in sets.calibrate for w in t.split()}
    assert any(len(t.split()) >= 200 for t in sets.probe) and any(len(t.split()) <= 2 for t in sets.probe)
    # a text that is in both halves of the file is judged not at all
    calibrate, judge = split_texts(["a", "b", "c", "a", "d"])
    assert calibrate == ["a", "c", "d"] and judge == ["b"]


def test_a_judged_minimum_exactly_at_the_threshold_is_refused() -> None:
    from embedfleet.runtime.engines.int8_gate import INT8_MARGIN_FACTOR, verdict

    assert INT8_MARGIN_FACTOR > 1
    figures = {"min_cosine": 0.99, "mean_cosine": 0.998, "worst_input": 3, "finite": True}
    refused = verdict(figures, 0.99)
    assert not refused.passed and refused.required > 0.99
    assert "judged input 3" in refused.reason and "margin factor" in refused.reason
    assert verdict({**figures, "min_cosine": refused.required}, 0.99).passed
    assert verdict(figures, 0.99, margin_factor=1.0).passed, "without the margin it would pass"
    assert not verdict({**figures, "min_cosine": 1.0, "finite": False}, 0.99).passed


# -- real builds ------------------------------------------------------------------------------------------------
def test_a_build_is_quantised_on_texts_it_is_not_judged_on(builds: dict[int, Path],
                                                           seen: dict[str, list[tuple[int, ...]]]) -> None:
    """Spied on in a real build (`builds`): what the quantiser calibrates on, what the int8 engine embeds
    while being judged."""
    assert builds and seen["quantised"] and seen["judged"]
    both = set(seen["quantised"]) & set(seen["judged"])
    assert not both, f"{len(both)} of {len(set(seen['judged']))} judged inputs were calibrated on"


def test_a_judged_minimum_at_the_threshold_refuses_the_start(tiny: dict[str, ModelSpec], builds: dict[int, Path],
                                                             tmp_path: Path) -> None:
    """The stored figures of a real build set to exactly the threshold: without a margin that passed."""
    manifest_file = copy_cache(builds[0], tmp_path / "engines") / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "min_cosine": 0.99}))
    with pytest.raises(Int8Rejected, match="margin factor"):
        build_int8_engine(tiny[0], num_threads=THREADS, cache_root=tmp_path / "engines", min_cosine=0.99)


def replace_weights(build: Path, other: Path) -> None:
    """Another model's int8 weights, same graph: a build that loads and runs and embeds something else."""
    for name in ("model.xml", "model.bin"):
        shutil.copyfile(other / name, build / name)


def zero_weights(build: Path, other: Path) -> None:
    """The weights file zeroed in place (same size): a build that loads and runs and embeds nothing."""
    (build / "model.bin").write_bytes(bytes((build / "model.bin").stat().st_size))


@pytest.mark.parametrize("spoil", [replace_weights, zero_weights])
def test_a_forged_verdict_over_a_bad_build_is_never_served(tiny: dict[str, ModelSpec], builds: dict[int, Path],
                                                           tmp_path: Path, spoil,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """What a tenant's pod can write into its engines folder: bad weights, and an int8.json saying min cosine
    1.0. The next start judges the build again on the probe texts, finds it bad, builds it again and serves
    that; the stored verdict is not what decides."""
    spec = tiny[0]
    folder = copy_cache(builds[0], tmp_path / "a")
    (other,) = builds[1].rglob(MANIFEST)
    spoil(folder, other.parent)
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "min_cosine": 1.0, "mean_cosine": 1.0, "finite": True}))

    with caplog.at_level(logging.INFO, logger="embedfleet.runtime.engines.int8_cpu"):
        served = build_int8_engine(spec, num_threads=THREADS, cache_root=tmp_path / "a")
    fp32 = TorchEngine(spec, dtype="float32", num_threads=THREADS)
    if isinstance(served, Int8CpuEngine):
        cos = row_cosines(fp32.embed(BATCH), served.embed(BATCH))
        assert cos.min() >= 0.99, f"a bad build was served as int8: cosine {cos.min():.4f} with float32"
        assert served.build_source is not None and served.build_source.source == "built"
        assert served.int8_gate.min_cosine < 1.0, "the verdict served is the rebuild's, not the forged one"
    lines = [r.getMessage() for r in caplog.records]
    assert any("fails its re-judgement" in line and str(folder) in line for line in lines), lines
    # the rebuilt folder is a good build again: the next start re-judges it and keeps it
    again = build_int8_engine(spec, num_threads=THREADS, cache_root=tmp_path / "a")
    assert isinstance(again, Int8CpuEngine) and again.build_source.source == "cache"
    np.testing.assert_allclose(again.embed(BATCH), served.embed(BATCH), rtol=0, atol=1e-5)
