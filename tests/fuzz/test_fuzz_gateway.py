"""The runtime's OpenAPI document fuzzed through `embedfleet gateway`: the gateway forwards every route
(and answers /health, /ready, /metrics and /v1/models itself), so the same requests must get the same
kinds of answer, with no 5xx of the gateway's own making."""

from __future__ import annotations

import httpx
import pytest

from tests.fuzz.harness import fuzz

pytestmark = pytest.mark.timeout(900)


def test_through_the_gateway(gateway):
    report = fuzz(gateway.url)
    print(report.summary())
    assert set(report.statuses) == set(report.operations), report.summary()
    assert report.statuses["POST /v1/embeddings"].get(200), report.summary()
    assert not report.failures, report.summary()


@pytest.mark.parametrize("body", [b"\x00", b'{"model": "", "texts": ["a"], "input_type": "search_query", '
                                           b'"embedding_types": ["float"]}'], ids=["malformed", "unknown model"])
def test_gateway_refusals_on_cohere_routes_are_cohere_shaped(gateway, body):
    resp = httpx.post(f"{gateway.url}/v2/embed", content=body, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code in (400, 404, 422)
    assert set(resp.json()) == {"id", "message", "code"}, resp.text
