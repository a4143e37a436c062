"""How a list of inputs is cut into requests.

A request is capped both by count (servers limit inputs per request) and by characters (a proxy for
payload size and tokens, so one request of long documents does not time out while short ones fly).
Batches are contiguous ranges, which keeps re-assembly in input order a plain concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(
    lengths: Sequence[int], max_count: int, max_chars: int | None = None
) -> list[tuple[int, int]]:
    """Split inputs with the given character lengths into contiguous `(start, stop)` ranges.

    Each range holds at most `max_count` inputs and at most `max_chars` characters, except that an
    input longer than `max_chars` on its own still gets a range (it cannot be split further).
    """
    if max_count < 1:
        raise ValueError("max_count must be >= 1")
    if max_chars is not None and max_chars < 1:
        raise ValueError("max_chars must be >= 1")
    n = len(lengths)
    if max_chars is None:
        return [(s, min(s + max_count, n)) for s in range(0, n, max_count)]
    out: list[tuple[int, int]] = []
    start = 0
    chars = 0
    for i, length in enumerate(lengths):
        count = i - start
        if count and (count >= max_count or chars + length > max_chars):
            out.append((start, i))
            start, chars = i, 0
        chars += length
    if start < n:
        out.append((start, n))
    return out
