"""Pinning across gateways and regions, with real runtimes (two revisions of the embedded model, each its own
vector space) and real gateway processes: a name is never answered from another space's index.

* One gateway, both revisions listed under one name: every answer comes from the space the name resolves to
  (the first routable upstream listed, or --vector-space), whatever least-wait would prefer.
* A replica whose space the gateway could not learn (its /v1/models wants an API key) refuses the pinned
  request (409) and the gateway does not pass that off as an answer.
* Two regions mid-rollout: `a` resolves the name to r2's space, `b` still to r1's. A request to `a` that spills
  to `b` is refused there (409) and `a` answers 503 saying why; `model@r1` spills and is answered by r1.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from embedfleet.compat.names import HEADER_REVISION, HEADER_VECTOR_SPACE
from tests.gateway.conftest import MODEL, start_gateway
from tests.procs import free_port, start_runtime

KEY = "pinning-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def revisions():
    """r1: an open runtime; r2: the same model as a breaking revision (its own vector space), behind a key."""
    r1 = start_runtime("--revision", "r1", "--probe-interval", "0")
    r2 = start_runtime("--revision", "r2", "--probe-interval", "0", env={"EMBEDFLEET_API_KEY": KEY})
    yield r1, r2
    for srv in (r1, r2):
        srv.stop()


def embed(gateway_url: str, model: str, text: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{gateway_url}/v1/embeddings", json={"model": model, "input": text},
                      headers={**AUTH, **(headers or {})}, timeout=60)


async def burst(url: str, model: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/embeddings", json={"model": model, "input": f"q {i}"})
                                      for i in range(n)))


def test_the_runtimes_serve_two_spaces_and_refuse_each_others_pins(revisions):
    r1, r2 = revisions
    one = httpx.post(f"{r1.url}/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=60)
    assert one.status_code == 200 and one.headers[HEADER_VECTOR_SPACE] == "r1"
    refused = httpx.post(f"{r2.url}/v1/embeddings", json={"model": MODEL, "input": "x"},
                         headers={**AUTH, HEADER_VECTOR_SPACE: "r1"}, timeout=60)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "vector_space_mismatch"


def test_one_gateway_never_answers_a_name_from_a_replica_of_another_space(revisions):
    r1, r2 = revisions
    first_r1 = start_gateway("--upstream", f"{MODEL}={r1.url}", "--upstream", f"{MODEL}={r2.url}")
    declared = start_gateway("--upstream", f"{MODEL}={r2.url}", "--upstream", f"{MODEL}={r1.url}",
                             "--vector-space", f"{MODEL}=r2")
    try:
        for gateway, space in ((first_r1, "r1"), (declared, "r2")):
            answers = [embed(gateway.url, MODEL, f"one at a time {i}") for i in range(10)]
            assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers if a.status_code != 200]
            # least-wait would spread a burst over both replicas; on a busy machine the one replica of the
            # space may shed some of it (429 overloaded, its own admission): never another space's answer
            answers += asyncio.run(burst(gateway.url, MODEL, 12))
            assert {a.status_code for a in answers} <= {200, 429}, [a.text for a in answers if a.status_code >= 300]
            answered = [a for a in answers if a.status_code == 200]
            assert {a.headers[HEADER_VECTOR_SPACE] for a in answered} == {space}
            assert {a.headers[HEADER_REVISION] for a in answered} == {space}
            assert gateway.count("embedfleet_gateway_requests_total", deployment=MODEL, code="409") == 0
    finally:
        first_r1.stop()
        declared.stop()


def test_a_replica_that_refuses_the_pin_is_skipped_not_answered(revisions):
    _, r2 = revisions
    # r2's /v1/models wants the key, so this gateway cannot know its space before sending it a request
    gateway = start_gateway("--upstream", f"{MODEL}={r2.url}", "--vector-space", f"{MODEL}=r1",
                            "--hold-timeout", "1")
    try:
        answer = embed(gateway.url, MODEL, "pinned to r1, only r2 up")
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "vector_space_unavailable"
        assert "resolves to vector space 'r1'" in error["message"] and "different revision" in error["message"]
        assert gateway.count("embedfleet_gateway_retries_total", deployment=MODEL, reason="vector_space") == 1
        assert gateway.count("embedfleet_gateway_requests_total", deployment=MODEL, code="200") == 0
    finally:
        gateway.stop()


def test_a_request_that_arrives_pinned_goes_only_to_its_space(revisions):
    r1, r2 = revisions
    # r2's card is behind its key: the side-by-side name's space is declared, as the cluster's status declares it
    gateway = start_gateway("--upstream", f"{MODEL}={r1.url}", "--upstream", f"{MODEL}@r2={r2.url}",
                            "--vector-space", f"{MODEL}@r2=r2")
    try:
        plain = embed(gateway.url, MODEL, "no pin")
        assert plain.status_code == 200 and plain.headers[HEADER_VECTOR_SPACE] == "r1"
        pinned = embed(gateway.url, MODEL, "pinned to r2", {HEADER_VECTOR_SPACE: "r2"})
        assert pinned.status_code == 200, pinned.text
        assert pinned.headers[HEADER_VECTOR_SPACE] == "r2", "the side-by-side revision of that space answers"
        cards = {c["id"]: c for c in httpx.get(f"{gateway.url}/v1/models", headers=AUTH, timeout=60).json()["data"]}
        assert cards[MODEL]["vector_space"] == "r1" and cards[f"{MODEL}@r2"]["vector_space"] == "r2"
        nowhere = embed(gateway.url, MODEL, "pinned to r7", {HEADER_VECTOR_SPACE: "r7"})
        assert nowhere.status_code == 409 and nowhere.json()["error"]["code"] == "vector_space_mismatch"
        assert "'r7'" in nowhere.json()["error"]["message"]
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def regions(revisions):
    """Region b still serves r1 (both as the bare name and as `@r1`); region a has flipped the name to r2 and
    has no replica up, so it spills to b."""
    r1, _ = revisions
    dead = f"http://127.0.0.1:{free_port()}"
    b = start_gateway("--region", "b", "--upstream", f"{MODEL}={r1.url}", "--upstream", f"{MODEL}@r1={r1.url}")
    a = start_gateway("--region", "a", "--upstream", f"{MODEL}={dead}", "--vector-space", f"{MODEL}=r2",
                      "--spill", f"{MODEL}=b={b.url}", "--upstream", f"{MODEL}@r1={dead}",
                      "--vector-space", f"{MODEL}@r1=r1", "--spill", f"{MODEL}@r1=b={b.url}", "--hold-timeout", "1")
    yield a, b
    for gw in (a, b):
        gw.stop()


def test_a_spilled_request_is_never_answered_by_a_region_a_flip_behind(regions, revisions):
    a, b = regions
    r1, _ = revisions
    ran_before = r1.metric("embedfleet_inputs_total")
    answer = embed(a.url, MODEL, "region a resolves this to r2")
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "vector_space_unavailable"
    assert "resolves to vector space 'r2'" in error["message"] and "regions it could spill to (b)" in error["message"]
    assert "different revision" in error["message"]
    assert b.count("embedfleet_gateway_requests_total", deployment=MODEL, code="409") >= 1, "b refused it"
    assert r1.metric("embedfleet_inputs_total") == ran_before, "r1's runtime never ran it"
    assert a.count("embedfleet_gateway_spilled_total", deployment=MODEL, to="b") == 0


def test_the_old_revision_by_name_spills_and_is_answered(regions):
    a, b = regions
    answer = embed(a.url, f"{MODEL}@r1", "the old index's queries")
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER_VECTOR_SPACE] == "r1" and answer.headers[HEADER_REVISION] == "r1"
    assert a.count("embedfleet_gateway_spilled_total", deployment=f"{MODEL}@r1", to="b") == 1
    assert b.count("embedfleet_gateway_requests_total", deployment=f"{MODEL}@r1", code="200") == 1
