"""The batch planner finds the cheapest window, as trying every window does, and stays fast at GPU sizes."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.runtime.core.batching import DEFAULT_OVERHEAD_TOKENS, Entry, best_window, plan_batch


def cost(lengths: Sequence[int], overhead: int) -> float:
    return (overhead + max(lengths) * len(lengths)) / sum(lengths)


def every_window(lengths: list[int], pos: int, max_tokens: int, max_items: int, overhead: int) -> tuple[int, int]:
    """The reference: every window that holds the anchor, smallest (cost, -count, lo) first. Quadratic in
    max_items, which is why the planner does not do this."""
    prefix = [0]
    for n in lengths:
        prefix.append(prefix[-1] + n)
    best: tuple[float, int, int, int] | None = None
    for count in range(min(max_items, len(lengths)), 0, -1):
        for lo in range(max(0, pos - count + 1), min(pos, len(lengths) - count) + 1):
            hi = lo + count - 1
            padded = lengths[hi] * count
            if padded > max_tokens and count > 1:
                continue
            key = ((overhead + padded) / (prefix[hi + 1] - prefix[lo]), -count, lo, hi)
            if best is None or key < best:
                best = key
    assert best is not None
    return best[2], best[3]


windows = st.lists(st.integers(1, 512), min_size=1, max_size=300).map(sorted).flatmap(
    lambda lengths: st.tuples(st.just(lengths), st.integers(0, len(lengths) - 1)))


@settings(max_examples=300, deadline=None)
@given(windows, st.integers(1, 65536), st.integers(1, 200), st.sampled_from([0, 1, DEFAULT_OVERHEAD_TOKENS, 500]))
def test_best_window_costs_what_trying_every_window_costs(window, max_tokens, max_items, overhead):
    lengths, pos = window
    lo, hi = best_window(lengths, pos, max_tokens, max_items, overhead)
    assert lo <= pos <= hi and hi - lo + 1 <= max_items
    assert lengths[hi] * (hi - lo + 1) <= max_tokens or lo == hi
    rlo, rhi = every_window(lengths, pos, max_tokens, max_items, overhead)
    got, want = cost(lengths[lo:hi + 1], overhead), cost(lengths[rlo:rhi + 1], overhead)
    assert abs(got - want) <= 1e-9 * want, (got, want)
    if got == want:
        assert hi - lo >= rhi - rlo, "of equally cheap windows, the larger"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.builds(Entry, seq=st.integers(-10_000, 10_000), length=st.integers(1, 512), urgent=st.booleans(),
                          tenant=st.sampled_from(["", "a"])), min_size=1, max_size=400, unique_by=lambda e: e.seq),
       st.integers(1, 65536), st.integers(1, 200))
def test_planned_batches_cost_the_optimum(queue, max_tokens, max_items):
    chosen = plan_batch(queue, max_tokens, max_items)
    kind = [e for e in queue if e.urgent] or queue
    anchor = min(kind, key=lambda e: e.seq)
    peers = [e for e in kind if e.tenant == anchor.tenant]
    if len(peers) < len(kind) and (len(peers) >= max_items or sum(e.length for e in peers) >= max_tokens):
        kind = peers
    order = sorted(kind, key=lambda e: (e.length, e.seq))
    rlo, rhi = every_window([e.length for e in order], order.index(anchor), max_tokens, max_items,
                            DEFAULT_OVERHEAD_TOKENS)
    want = cost([e.length for e in order[rlo:rhi + 1]], DEFAULT_OVERHEAD_TOKENS)
    got = cost([queue[i].length for i in chosen], DEFAULT_OVERHEAD_TOKENS)
    assert abs(got - want) <= 1e-9 * want and anchor in [queue[i] for i in chosen]


def test_a_gpu_sized_queue_is_planned():
    """4,000 queued inputs, batches of up to 1,024: planned, within the caps, around the oldest item."""
    queue = [Entry(i, 5 + (i * 7919) % 296, False) for i in range(4000)]
    chosen = plan_batch(queue, 65536, 1024)
    assert 0 in chosen and len(set(chosen)) == len(chosen) <= 1024
    assert max(queue[i].length for i in chosen) * len(chosen) <= 65536
    many = plan_batch([Entry(i, 8, False) for i in range(4000)], 65536, 1024)
    assert len(many) == 1024, "equal lengths: a full batch"
