"""The answer comparison the split tests use: what it lets through, and what it does not."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from tests.answers import assert_same_answer


def answer(body: object, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=body)


def b64(values: list[float]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def test_float_rounding_passes() -> None:
    assert_same_answer(answer({"data": [{"embedding": [0.1, 0.2]}], "n": 3}),
                       answer({"data": [{"embedding": [0.1000001, 0.2]}], "n": 3}))
    assert_same_answer(answer([{"index": 0, "score": 0.5}]), answer([{"index": 0, "score": 0.5000004}]))
    assert_same_answer(answer({"embedding": b64([0.1, 0.2])}), answer({"embedding": b64([0.1000001, 0.2])}))
    assert_same_answer(answer({"embedding": [12, -3]}), answer({"embedding": [13, -3]}))  # int8: one step


@pytest.mark.parametrize("got, want", [
    ({"data": [{"embedding": [0.1, 0.2]}]}, {"data": [{"embedding": [0.1, 0.201]}]}),
    ({"embedding": b64([0.1, 0.2])}, {"embedding": b64([0.1, 0.3])}),
    ({"embedding": [12, -3]}, {"embedding": [14, -3]}),
    ({"usage": {"tokens": 5}}, {"usage": {"tokens": 6}}),
    ({"error": "a"}, {"error": "b"}),
    ({"a": 1}, {"a": 1, "b": 2}),
    ([[0.1, 0.2]], [[0.1, 0.2], [0.3, 0.4]]),
    ([{"index": 0, "score": 0.5}], [{"index": 1, "score": 0.5}]),
    ({"embedding": b64([0.1, 0.2])}, {"embedding": [0.1, 0.2]}),  # encoding_format ignored
    ({"embedding": [12, -3]}, {"embedding": [12.0, -3.0]}),  # int8 asked, floats sent
])
def test_a_real_difference_fails(got, want) -> None:
    with pytest.raises(AssertionError):
        assert_same_answer(answer(got), answer(want))


def test_statuses_and_non_json_bodies_compare_exactly() -> None:
    with pytest.raises(AssertionError):
        assert_same_answer(answer({"a": 1}, 200), answer({"a": 1}, 429))
    with pytest.raises(AssertionError):
        assert_same_answer(httpx.Response(200, content=b"x"), httpx.Response(200, content=b"y"))
