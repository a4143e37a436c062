"""Properties of the pure batching policy and of truncation."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.core.batching import Entry, padded_cost, plan_batch
from embedfleet.runtime.core.tokenize import truncate_encoding

entries = st.lists(
    st.builds(Entry, seq=st.integers(0, 10_000), length=st.integers(1, 512), urgent=st.booleans()),
    max_size=200, unique_by=lambda e: e.seq)


def anchor_of(queue: list[Entry], chosen: list[int], max_items: int) -> Entry | None:
    """The invariants every plan keeps (padded or packed); the anchor, or None for an empty queue."""
    if not queue:
        assert chosen == []
        return None
    assert chosen and len(set(chosen)) == len(chosen) <= max_items
    anchor = min([e for e in queue if e.urgent] or queue, key=lambda e: e.seq)
    assert anchor in [queue[i] for i in chosen], "the oldest (urgent) item always goes first: no starvation"
    if anchor.urgent:
        assert all(queue[i].urgent for i in chosen), "bulk work never rides in an urgent batch"
    return anchor


@given(entries, st.integers(1, 8192), st.integers(1, 64))
def test_plan_batch_invariants(queue, max_tokens, max_items):
    chosen = plan_batch(queue, max_tokens, max_items)
    if anchor_of(queue, chosen, max_items) is not None:
        lengths = [queue[i].length for i in chosen]
        assert padded_cost(lengths) <= max_tokens or len(chosen) == 1




def test_lengths_are_grouped_to_cut_padding():
    queue = [Entry(i, length, False) for i, length in enumerate([10, 250, 12, 240, 11, 245, 9, 255])]
    chosen = plan_batch(queue, max_tokens=4 * 255, max_items=4)
    assert sorted(queue[i].length for i in chosen) == [9, 10, 11, 12]
    queue += [Entry(100, 248, True), Entry(101, 30, True), Entry(102, 247, True)]
    chosen = plan_batch(queue, max_tokens=4 * 255, max_items=4)
    assert sorted(queue[i].length for i in chosen) == [247, 248], "the urgent anchor leads, with urgent peers only"


def test_small_batches_when_padding_would_dominate():
    """Twelve short items and twelve long ones: two tight batches beat one padded batch."""
    queue = [Entry(i, 8 if i % 2 else 200, False) for i in range(24)]
    chosen = plan_batch(queue, max_tokens=16384, max_items=32)
    assert {queue[i].length for i in chosen} == {200}  # the anchor (seq 0) is long: only long ones join
    assert len(chosen) == 12


def test_overhead_makes_tiny_batches_grow():
    """Lengths 8..15: padding a little is cheaper than paying the per-batch overhead again."""
    queue = [Entry(i, 8 + i % 8, False) for i in range(32)]
    assert len(plan_batch(queue, 16384, 32, overhead_tokens=48)) > 16
    assert len(plan_batch(queue, 16384, 32, overhead_tokens=0)) <= 4


def test_lone_query_goes_alone_immediately():
    assert plan_batch([Entry(7, 5, True)], 16384, 32) == [0]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40).map(lambda m: [1, *m, 1]),
       st.integers(1, 60), st.sampled_from(["right", "left"]))
def test_truncation_keeps_special_tokens(body_mask, limit, direction):
    mask = [1 if i in (0, len(body_mask) - 1) else 0 for i in range(len(body_mask))]
    ids = [1000 + i for i in range(len(mask))]
    out = truncate_encoding(ids, mask, limit, direction)
    if len(ids) <= limit:
        assert out == ids
        return
    assert len(out) == max(limit, 2)
    assert out[0] == ids[0] and out[-1] == ids[-1]
    body = out[1:-1]
    if direction == "right":
        assert body == ids[1:1 + len(body)]
    else:
        assert body == ids[len(ids) - 1 - len(body):-1]


def test_bulk_batches_are_sized_by_measured_speed():
    """Bulk work gets ~bulk_batch_seconds of engine time per batch; a queued urgent item lifts the cap."""
    from concurrent.futures import ThreadPoolExecutor

    from embedfleet.runtime.core.batcher import MIN_BULK_TOKENS, BatchManager
    from embedfleet.runtime.metrics import RuntimeMetrics

    with ThreadPoolExecutor(1) as pool:
        bm = BatchManager(lambda batch: batch, 16384, 32, 10**6, RuntimeMetrics().for_model("m"), pool,
                          bulk_batch_seconds=0.1)
        bulk = [Entry(0, 10, False), Entry(1, 20, False)]
        assert bm._budget(bulk) == 16384  # nothing measured yet: no cap
        bm._tokens_per_s = 10_000.0
        assert bm._budget(bulk) == 1000
        assert bm._budget([*bulk, Entry(2, 5, True)]) == 16384
        bm._tokens_per_s = 100.0
        assert bm._budget(bulk) == MIN_BULK_TOKENS
        bm.shared_batch_seconds = 0.02
        bm._tokens_per_s = 10_000.0
        assert bm._budget(bulk) == 1000, "no query seen lately: the bulk slice"
        bm._last_urgent = time.monotonic()
        assert bm._budget(bulk) == 200, "queries arriving: the shorter shared slice"
        bm._tokens_per_s = 100.0
        assert bm._budget(bulk) == 2 * bm.overhead_tokens, "never below two batches' fixed cost"
        bm.bulk_batch_seconds = 0
        assert bm._budget(bulk) == 16384


def test_a_preemptible_engine_runs_bulk_batches_one_layer_of_which_takes_the_slice():
    """A query waits one layer of a bulk batch on an engine that pauses between layers (preemption), so
    its bulk batches are sized for one layer to take `bulk_batch_seconds` (or the shared slice), not the
    whole batch: six layers, six times the tokens, up to --max-batch-tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from embedfleet.runtime.core.batcher import BatchManager
    from embedfleet.runtime.metrics import RuntimeMetrics

    with ThreadPoolExecutor(1) as pool:
        bm = BatchManager(lambda batch: batch, 16384, 32, 10**6, RuntimeMetrics().for_model("m"), pool,
                          bulk_batch_seconds=0.1, shared_batch_seconds=0.02)
        bm._tokens_per_s = 10_000.0
        bulk = [Entry(0, 10, False), Entry(1, 20, False)]
        assert bm._budget(bulk) == 1000
        bm.preemptible_in(6)
        assert bm._budget(bulk) == 6000, "one of six layers takes the bulk slice"
        bm._last_urgent = time.monotonic()
        assert bm._budget(bulk) == 1200, "one of six layers takes the shared slice"
        bm._last_urgent, bm._tokens_per_s = float("-inf"), 100_000.0
        assert bm._budget(bulk) == 16384, "never past --max-batch-tokens"


@given(entries, st.integers(1, 8192), st.integers(1, 64), st.booleans())
def test_packed_batches_leave_out_only_what_does_not_fit(queue, max_tokens, max_items, group_lengths):
    """A packed engine pays for real tokens: the batch holds the anchor, fits the budget in real tokens
    (a lone item always may), and while it has room for more items leaves out only what no longer fits, so
    no extra batch is paid for. On CPU (`group_lengths`) an urgent anchor's company is the items nearest it in
    length, shorter ones first: a longer item joins only once no shorter one that would fit is left. A bulk
    anchor's is the oldest, as without `group_lengths`."""
    chosen = plan_batch(queue, max_tokens, max_items, packed=True, group_lengths=group_lengths)
    anchor = anchor_of(queue, chosen, max_items)
    if anchor is None:
        return
    assert queue[chosen[0]] == anchor, "the anchor leads"
    total = sum(queue[i].length for i in chosen)
    assert total <= max_tokens or len(chosen) == 1
    left = [e for i, e in enumerate(queue) if i not in chosen and e.urgent == anchor.urgent]
    if len(chosen) < max_items:
        assert all(e.length > max_tokens - total for e in left), "an item that fits is never left for another batch"
    longer = [queue[i].length for i in chosen if queue[i].length > anchor.length]
    if group_lengths and anchor.urgent and longer:
        # each shorter one left out did not fit even without the shortest longer one
        assert all(e.length > anchor.length or e.length > max_tokens - total + min(longer) for e in left)
    if group_lengths and not anchor.urgent:
        assert chosen == plan_batch(queue, max_tokens, max_items, packed=True), "bulk: oldest first on CPU too"


def test_packed_batches_take_all_lengths_at_once():
    """The lengths that the padded plan splits (test_small_batches_when_padding_would_dominate) go in one
    packed batch: padding costs a packed engine nothing."""
    queue = [Entry(i, 8 if i % 2 else 200, False) for i in range(24)]
    assert len(plan_batch(queue, 16384, 32)) == 12
    assert sorted(plan_batch(queue, 16384, 32, packed=True)) == list(range(24))
    assert sorted(plan_batch(queue, 16384, 8, packed=True)) == list(range(8)), "the oldest, up to the cap"
    assert sorted(plan_batch(queue, 440, 32, packed=True)) == [0, 1, 2, 3, 5, 7, 9], \
        "the oldest that fit 440 real tokens: 200 + 8 + 200 + 8, then only the short ones"


def test_a_lone_query_on_a_packed_cpu_engine_is_batched_with_short_inputs():
    """On CPU a packed batch's time is its tokens: the oldest query goes with the other short inputs, not
    with the passages queued between them (oldest-first, the GPU's plan, would take those too)."""
    queue = [Entry(i, 10 if i % 3 == 0 else 250, True) for i in range(30)]
    chosen = plan_batch(queue, 16384, 8, packed=True, group_lengths=True)
    assert chosen[0] == 0 and len(chosen) == 8
    assert all(queue[i].length == 10 for i in chosen)
    assert any(queue[i].length == 250 for i in plan_batch(queue, 16384, 8, packed=True))


def test_bulk_requests_on_a_packed_cpu_engine_are_batched_in_arrival_order():
    """A bulk request is answered when its last input is: its inputs go oldest first, so the first request's
    inputs fill the first batch whatever their lengths, and its client can send the next one while the
    engine runs the rest (inputs of nearby lengths would take one or two of every request's into each batch)."""
    queue = [Entry(i, (10, 250, 40, 120)[i % 4], False) for i in range(128)]  # 4 requests x 32, mixed lengths
    chosen = plan_batch(queue, 16384, 32, packed=True, group_lengths=True)
    assert chosen == list(range(32))

