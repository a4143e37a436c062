"""The official openai SDK works unchanged against a real server process."""

from __future__ import annotations

import numpy as np
import openai


def test_openai_sdk_float_and_base64(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    texts = ["hello world", "the SDK decodes base64 with numpy"]
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    b64 = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the SDK's default is base64
    assert [d.index for d in floats.data] == [0, 1]
    a = np.array([d.embedding for d in floats.data])
    b = np.array([d.embedding for d in b64.data])
    assert a.shape == b.shape == (2, 384)
    np.testing.assert_allclose(a, b, atol=1e-7)
    assert floats.usage.prompt_tokens > 0 and floats.model == "all-MiniLM-L6-v2"
    short = client.embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=128)
    assert len(short.data[0].embedding) == 128


def test_openai_sdk_errors(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        client.embeddings.create(model="not-served", input="x")
    except openai.NotFoundError as exc:
        assert "not-served" in str(exc)
    else:
        raise AssertionError("unknown model accepted")
