"""The client against our real runtime process (`embedfleet serve`, default all-MiniLM-L6-v2)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("embedfleet.runtime.serve")

from embedfleet.client import Client


@pytest.fixture
def runtime_url(server) -> str:
    """The session's default server (tests/conftest.py): a real `embedfleet serve` process."""
    return server.url


def test_embeds_against_real_runtime(runtime_url):
    texts = ["A cat sits on the mat.", "Stock markets fell today.", "A cat sits on the mat.", "Kittens play."]
    with Client(runtime_url, batch_size=2) as c:
        b64 = c.embed(texts)
        floats = c.embed(texts, encoding_format="float")
        assert c.stats.usage.total_tokens > 0
    assert b64.shape == (4, 384)
    np.testing.assert_allclose(np.linalg.norm(b64, axis=1), 1.0, atol=1e-3)
    np.testing.assert_allclose(b64[0], b64[2], atol=1e-5)  # same text, same row, in input order
    np.testing.assert_allclose(b64, floats, atol=1e-5)
    assert float(b64[0] @ b64[3]) > float(b64[0] @ b64[1])  # cats are closer to kittens than to stocks
