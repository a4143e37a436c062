"""Requests found at the edges by the fuzz tests, kept as plain requests with the answer each must get.

Each was sent by tests/fuzz (after a load storm as well as on a fresh server); copy a new failing
request from a fuzz report here, with the status and error body it gets once fixed.
"""

from __future__ import annotations

import pytest

ERROR_KEYS = {"message", "type", "code"}


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"input": "x", "timeout": 5e-324}, 504, "deadline_exceeded"),  # the least positive float: cannot be met
    ({"input": "x", "timeout": 1e308}, 200, None),  # a deadline past any clock's range is no deadline
    ({"input": "x", "timeout": 0}, 422, "invalid_request"),  # the schema's exclusiveMinimum
])
def test_body_timeout_at_its_edges(fresh_runtime, body, status, code):
    with fresh_runtime.client() as c:
        resp = c.post("/v1/embeddings", json=body)
        assert resp.status_code == status, resp.text
        if code is not None:
            assert set(resp.json()["error"]) == ERROR_KEYS and resp.json()["error"]["code"] == code, resp.text


@pytest.mark.parametrize("value", ["1e300", "inf", "nan", "0", "-1"])
def test_request_timeout_header_at_its_edges(fresh_runtime, value):
    with fresh_runtime.client() as c:
        resp = c.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-timeout": value})
        if value == "1e300":
            assert resp.status_code == 200, resp.text
        else:
            assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_timeout", resp.text
