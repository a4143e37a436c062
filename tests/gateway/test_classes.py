"""Request classes: bulk by the runtime's header or by input count, as the runtime judges them."""

from __future__ import annotations

import pytest

from embedfleet.gateway.classes import input_count, is_bulk


@pytest.mark.parametrize(("doc", "count"), [
    ({"input": "one text"}, 1), ({"input": ["a", "b", "c"]}, 3), ({"input": [101, 2023, 102]}, 1),
    ({"input": [[101, 102], [101, 103]]}, 2), ({"inputs": ["a"] * 7}, 7), ({"texts": ["a", "b"]}, 2),
    ({"query": "q", "documents": ["a"] * 9}, 9), ({"model": "m"}, 1), (["not", "an", "object"], 1),
])
def test_input_count(doc, count):
    assert input_count(doc) == count


def test_bulk_by_header_or_by_size():
    assert is_bulk("bulk", 1) and is_bulk(" BULK ", 1)
    assert not is_bulk("high", 1) and not is_bulk(None, 4)
    assert is_bulk(None, 5) and not is_bulk(None, 5, urgent_max_inputs=8)
