"""The whole batching policy, as one pure function.

Continuous batching: whenever the engine is free we plan a batch from whatever is queued, never
waiting for a batch to fill (so a lone query takes the fast path). A batch is anchored on an urgent
item when there is one (else on any item), so queries go before bulk work; urgent batches take only
urgent items, so a query never waits for bulk work packed beside it.

Within that class the anchor is the oldest item of the tenant served least lately (`served`: tokens
run per tenant, decayed by the caller), so tenants of one class take turns instead of the oldest
backlog winning every batch; with one tenant this is simply the oldest item, so nothing starves.
When the chosen tenant alone has a full batch queued, the batch is that tenant's only: another
tenant's backfill then cannot fill the engine around a tenant whose turn it is. Around the anchor we pick the run of
similar lengths that costs least per real token, with the engine's cost modelled as
`overhead + longest x count`: padding is wasted work, and so is a forward pass too small to amortise
its fixed overhead (measured on the CPU engine: ~4.5 ms, the time of ~45 tokens). The cheapest run is
found without trying every one (`best_window`), so a GPU's batches of a thousand inputs plan as fast as
a CPU's of thirty-two.

An engine that runs packed sequences (BERT-family embedders: engines/packed.py, engines/packed_cpu.py) pays for its real
tokens, not for rows x the longest row: there, padding costs nothing and every extra batch costs its fixed
overhead again, on the GPU and on the host that plans, hands over and answers it. Its batches (`packed`)
are the anchor and then the oldest items of the class that fit, up to the budget counted in real tokens:
as few batches as the budget allows, and no sort by length.

On CPU a packed batch's time is its tokens, and there a lone query batched with thirty passages waits for
all of them (a GPU runs such a batch in milliseconds). A packed CPU engine's urgent batches (`group_lengths`:
queries of up to `--urgent-max-inputs` inputs, and bulk work promoted near its deadline) are the anchor and
then the items nearest it in length, shorter ones first, that fit: as full as the oldest-first batch, still
unpadded, but a short query's batch holds short inputs. Bulk batches stay oldest-first there too: a bulk
request is answered when the last of its inputs is, so taking its inputs in arrival order answers each
request as early as the engine can, while nearby lengths spread every request over the whole queue, so
that the requests end together and the engine idles while their clients send the next ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress
from operator import attrgetter
from typing import Protocol

DEFAULT_OVERHEAD_TOKENS = 48
SEQ, TENANT, URGENT = attrgetter("seq"), attrgetter("tenant"), attrgetter("urgent")


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int  # arrival order: lower is older
    length: int  # tokens
    urgent: bool
    tenant: str = ""


class Queued(Protocol):
    """What the planner reads of a queued input: an `Entry`, or the batch manager's `Item` (its own entry)."""

    @property
    def seq(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def urgent(self) -> bool: ...

    @property
    def tenant(self) -> str: ...


def padded_cost(lengths: Sequence[int]) -> int:
    return max(lengths) * len(lengths) if lengths else 0


def batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """The tokens a batch of these input lengths costs the engine: padded to the longest, or with a packed
    engine (which pads nothing) the real ones. What plans, metrics and traces count alike."""
    return sum(lengths) if packed else padded_cost(lengths)


def pick_anchor(queue: Sequence[Queued], candidates: list[int], served: Mapping[str, float]) -> int:
    """The oldest candidate of the least-served tenant (ties: the tenant whose oldest item is older).
    With one tenant queued (the common case) that is the oldest candidate, found without a Python-level
    loop: this runs on every plan, over the whole queue."""
    entries = list(map(queue.__getitem__, candidates))
    if len(set(map(TENANT, entries))) == 1:
        seqs = list(map(SEQ, entries))
        return candidates[seqs.index(min(seqs))]
    oldest: dict[str, int] = {}
    for i in candidates:
        t = queue[i].tenant
        if t not in oldest or queue[i].seq < queue[oldest[t]].seq:
            oldest[t] = i
    return min(oldest.values(), key=lambda i: (served.get(queue[i].tenant, 0.0), queue[i].seq))


def plan_batch(queue: Sequence[Queued], max_tokens: int, max_items: int,
               overhead_tokens: int = DEFAULT_OVERHEAD_TOKENS, served: Mapping[str, float] | None = None,
               packed: bool = False, group_lengths: bool = False) -> list[int]:
    """Indices into `queue` of the next batch.

    Invariants (property-tested): non-empty when the queue is; contains the anchor; cost (padded, or
    with `packed` the real tokens) within `max_tokens` unless the anchor alone exceeds it; at most
    `max_items` items; all urgent when the anchor is; the anchor belongs to the least-served tenant with
    work in its class.
    """
    if not queue:
        return []
    urgent = list(compress(range(len(queue)), map(URGENT, queue)))
    candidates = urgent or list(range(len(queue)))
    anchor = pick_anchor(queue, candidates, served or {})
    tenant = queue[anchor].tenant
    if len(set(map(TENANT, map(queue.__getitem__, candidates)))) > 1:
        own = [i for i in candidates if queue[i].tenant == tenant]
        if len(own) >= max_items or sum(queue[i].length for i in own) >= max_tokens:
            candidates = own
    if packed and group_lengths and queue[anchor].urgent:
        return nearest_that_fit(queue, candidates, anchor, max_tokens, max_items)
    if packed:
        return oldest_that_fit(queue, candidates, anchor, max_tokens, max_items)
    order = by_length(queue, candidates)
    pos = order.index(anchor)
    lo, hi = max(0, pos - max_items + 1), min(len(order), pos + max_items)  # all a window can reach
    order = order[lo:hi]
    lo, hi = best_window([queue[i].length for i in order], pos - lo, max_tokens, max_items, overhead_tokens)
    return order[lo:hi + 1]


def oldest_that_fit(queue: Sequence[Queued], candidates: list[int], anchor: int, max_tokens: int,
                    max_items: int) -> list[int]:
    """The anchor, then `candidates` oldest first while their real tokens fit in `max_tokens` (an item that
    does not fit is passed over for younger, shorter ones: it anchors a batch of its own in its turn)."""
    return fill(queue, anchor, lambda: sorted(candidates, key=lambda i: queue[i].seq), len(candidates),
                max_tokens, max_items)


def nearest_that_fit(queue: Sequence[Queued], candidates: list[int], anchor: int, max_tokens: int,
                     max_items: int) -> list[int]:
    """The anchor, then `candidates` no longer than it from the longest down, then longer ones from the
    shortest up, each while its real tokens fit in `max_tokens` (an item that does not fit is passed over
    for shorter ones)."""
    def order() -> Iterable[int]:
        ordered = by_length(queue, candidates)
        pos = ordered.index(anchor)
        return chain(reversed(ordered[:pos]), ordered[pos + 1:])

    return fill(queue, anchor, order, len(candidates), max_tokens, max_items)


def fill(queue: Sequence[Queued], anchor: int, order: Callable[[], Iterable[int]], candidates: int,
         max_tokens: int, max_items: int) -> list[int]:
    """The anchor, then the items of `order()` (indices into `queue`, other than the anchor) that still fit
    in `max_tokens` real tokens, until `max_items`. `order` is called only when another item may join (of
    `candidates` items in all): a lone query's plan sorts nothing."""
    chosen = [anchor]
    room = max_tokens - queue[anchor].length
    if candidates == 1 or max_items == 1 or room <= 0:
        return chosen
    for i in order():
        length = queue[i].length
        if length <= room and i != anchor:
            chosen.append(i)
            room -= length
            if len(chosen) == max_items or room <= 0:
                break
    return chosen


def by_length(queue: Sequence[Queued], candidates: list[int]) -> list[int]:
    """`candidates` sorted by (length, seq). One integer key per item rather than a tuple: on a queue of
    thousands (a GPU's backlog) the sort is most of a plan, and integers compare at half a tuple's cost."""
    seqs = [queue[i].seq for i in candidates]
    low = min(seqs)
    span = max(seqs) - low + 1
    return sorted(candidates, key=lambda i: queue[i].length * span + queue[i].seq - low)


def best_window(lengths: Sequence[int], pos: int, max_tokens: int, max_items: int,
                overhead_tokens: int = DEFAULT_OVERHEAD_TOKENS) -> tuple[int, int]:
    """The window [lo, hi] of `lengths` (sorted ascending) around `pos` that costs least per real token,
    `(overhead + lengths[hi] x count) / sum(lengths[lo..hi])`; ties go to the larger window, then to
    the one further left. Windows hold at most `max_items` and pad to at most `max_tokens` (a lone item
    always may). Lengths are at least 1: every input has a token. O(len(lengths) + max_items): one sweep
    over the right ends, so that batches of a thousand inputs (a GPU's) are planned in about a
    millisecond; trying every window was quadratic in `max_items`.

    Why a sweep is enough. With `hi` fixed, taking in one more item on the left adds L[hi] to the
    numerator and L[lo-1] to the denominator, so it lowers the cost exactly when L[hi] / L[lo-1] is below
    the cost so far (the new cost is the mediant of the two). That ratio only grows as lo moves left (the
    lengths are sorted), and once it is above the cost it stays above every later cost (each new cost
    lies between the old cost and the ratio). So "the next item on the left does not raise the cost"
    holds while the window grows from `hi` and then never again: the cheapest window ending at `hi` (and
    the largest of equally cheap ones) starts where it first fails, and within the sizes the anchor and
    the caps allow, the cheapest is that size clipped to them. Where it first fails only moves right as
    `hi` does: with a the length of the item at lo-1, the test is S / a <= overhead / L[hi] + count (S the
    window's sum); one step of `hi` adds L[hi+1] / a >= 1 to the left side and at most 1 to the right,
    so a test that failed still fails. One pointer therefore walks left to right once, in step with `hi`.
    Costs are compared as exact integer fractions, never as floats.
    """
    prefix = list(accumulate(lengths, initial=0))  # the sum of lengths[lo..hi] is prefix[hi + 1] - prefix[lo]
    # where the cheapest window ending at hi starts, before the caps clip it; it only moves right
    start = max(0, pos - max_items)
    best_num, best_den, best_lo, best_hi = overhead_tokens + lengths[pos], lengths[pos], pos, pos
    cap = max_items if max_items < len(lengths) - pos else len(lengths) - pos
    for hi in range(pos, pos + cap):  # (min and max as comparisons: this loop is the planner's hot spot)
        top, total = lengths[hi], prefix[hi + 1]
        least = hi - pos + 1  # the window must reach left to the anchor
        most = max_tokens // top
        if most < least:  # too long to pad to: every further hi is longer and needs more items
            if hi > pos:
                break
            most = 1  # the anchor alone always may
        if most > max_items:
            most = max_items
        # move on while the item left of `start + 1` would raise the cost of [start + 1, hi]
        while start < hi and top * (total - prefix[start + 1]) > lengths[start] * (
                overhead_tokens + top * (hi - start)):
            start += 1
        count = hi - start + 1
        if count < least:
            count = least
        elif count > most:
            count = most
        lo = hi - count + 1
        num, den = overhead_tokens + top * count, total - prefix[lo]
        if num * best_den < best_num * den or (
                num * best_den == best_num * den and (best_lo - best_hi, best_lo) > (lo - hi, lo)):
            best_num, best_den, best_lo, best_hi = num, den, lo, hi
    return best_lo, best_hi
