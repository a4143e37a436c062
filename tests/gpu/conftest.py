"""Fixtures for the GPU engine's tests: tiny random models (CPU) and a CUDA guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import build_all

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU: torch.cuda.is_available() is False (run on an H100/H200 session)")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return build_all(tmp_path_factory.mktemp("tiny-gpu"))
