"""The whole batching policy, as one pure function.

Continuous batching: whenever the engine is free we plan a batch from whatever is queued, never
waiting for a batch to fill (so a lone query takes the fast path). A batch is anchored on the oldest
urgent item (or the oldest item), so nothing starves, then grows with the items closest in length,
because padded cost is longest x count and mixing a 10-token query with a 256-token passage wastes
most of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int  # arrival order: lower is older
    length: int  # tokens
    urgent: bool


def padded_cost(lengths: Sequence[int]) -> int:
    return max(lengths) * len(lengths) if lengths else 0


def plan_batch(queue: Sequence[Entry], max_tokens: int, max_items: int) -> list[int]:
    """Indices into `queue` of the next batch.

    Invariants (property-tested): non-empty when the queue is; contains the anchor; padded cost
    within `max_tokens` unless the anchor alone exceeds it; at most `max_items` items.
    """
    if not queue:
        return []
    urgent = [i for i, e in enumerate(queue) if e.urgent]
    pool = urgent or range(len(queue))
    anchor = min(pool, key=lambda i: queue[i].seq)
    order = sorted(range(len(queue)), key=lambda i: (queue[i].length, queue[i].seq))
    pos = order.index(anchor)
    lo = hi = pos  # inclusive window in length order; queue[order[hi]] is the longest
    count = 1
    while count < max_items:
        longest = queue[order[hi]].length
        can_left = lo > 0 and longest * (count + 1) <= max_tokens
        right_len = queue[order[hi + 1]].length if hi + 1 < len(order) else None
        can_right = right_len is not None and right_len * (count + 1) <= max_tokens
        if not (can_left or can_right):
            break
        if can_left and can_right:
            # take the side that wastes less padding: the left item pads up to `longest`,
            # the right item forces every current item up to `right_len`.
            left_waste = longest - queue[order[lo - 1]].length
            right_waste = (right_len - longest) * count
            take_left = left_waste <= right_waste
        else:
            take_left = can_left
        if take_left:
            lo -= 1
        else:
            hi += 1
        count += 1
    return [order[k] for k in range(lo, hi + 1)]
