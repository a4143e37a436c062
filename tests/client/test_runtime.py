"""The client against our real runtime process (`embedfleet serve`, default all-MiniLM-L6-v2)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("embedfleet.runtime.serve")

from embedfleet.client import Client

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runtime_url():
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    paths = [str(ROOT / p) for p in ("runtime", "operator", "client")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    log = tempfile.NamedTemporaryFile(prefix="embedfleet-client-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "embedfleet.runtime.cli", "serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(Path(log.name).read_text()[-3000:])
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


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
