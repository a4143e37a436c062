"""Replica division: a total over clusters by weight, under per-cluster floors and caps.

Floors are granted first, the rest is split by weight with water-filling (a cluster whose share would
exceed its cap is fixed at the cap and the others share what is left), then rounded with the largest
remainder method. Ties on the remainder go to the cluster that had more replicas before, then to the
earlier cluster in division order, so rounding never flips between equal clusters from one run to the next.

Stability: shares are proportional to static weights, so a small change of the total moves only the
clusters whose rounded share changes (about the change itself, spread over the largest remainders),
never a reshuffle.

``place`` works on arrays (one entry per cluster, in division order: `divide_arrays`, `duplicate`);
`divide` is the same division keyed by cluster name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def divide(
    total: int,
    names: Sequence[str],
    weights: Mapping[str, float],
    caps: Mapping[str, int],
    floors: Mapping[str, int] | None = None,
    previous: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Split ``total`` over ``names``; the result never exceeds a cap and may sum to less than ``total`` only
    when the caps leave no room. Remainder ties go to the larger ``previous``, then to the earlier name."""
    shares = divide_arrays(
        total,
        np.array([weights.get(n, 0) for n in names], dtype=np.float64),
        np.array([caps.get(n, 0) for n in names], dtype=np.int64),
        np.array([floors.get(n, 0) for n in names], dtype=np.int64) if floors else None,
        np.array([previous.get(n, 0) for n in names], dtype=np.int64) if previous else None,
    )
    return dict(zip(names, shares.tolist(), strict=True))


def divide_arrays(
    total: int, weights: np.ndarray, caps: np.ndarray, floors: np.ndarray | None = None,
    previous: np.ndarray | None = None,
) -> np.ndarray:
    """`divide` over arrays in division order (floors and previous: None when there are none)."""
    n = len(caps)
    if floors is None and n and weights[0] > 0 and bool((weights == weights[0]).all()):
        even = divide_even(total, caps, previous)
        if even is not None:
            return even
    floor = np.zeros(n, dtype=np.int64) if floors is None else floors
    alloc = np.minimum(floor, caps)
    remaining = total - int(alloc.sum())
    if remaining <= 0:
        return alloc
    room = caps - alloc
    # Water-filling: whoever the weighted share would push past its room is fixed at its room, the others
    # share what is left. `left` holds whole numbers, so the order of the subtractions does not matter.
    share = np.zeros(n)
    shared = np.zeros(n, dtype=bool)
    free = (weights > 0) & (room > 0)
    left = float(remaining)
    while free.any():
        weight_sum = sum(weights[free].tolist())  # in division order, as a plain sum of the cluster weights
        quota = left * weights / weight_sum
        over = free & (quota >= room)
        if not over.any():
            share[free] = quota[free]
            shared |= free
            break
        share[over] = room[over]
        shared |= over
        left -= int(room[over].sum())
        free &= ~over
        if left <= 0:
            break
    whole = np.minimum(room, np.floor(share + 1e-9).astype(np.int64))
    exact = alloc + share
    alloc = alloc + whole
    rest = remaining - int(whole.sum())
    if rest > 0:  # largest remainder, then the larger previous, then division order
        open_ = np.flatnonzero(shared & (whole < room))
        before = previous[open_] if previous is not None else np.zeros(len(open_), dtype=np.int64)
        ranked = open_[np.lexsort((open_, -before, -(share[open_] - whole[open_])))]
        alloc[ranked[:rest]] += 1
    if previous is not None:
        kept = _incremental(int(alloc.sum()), exact, caps, floor, previous)
        if kept is not None:
            return kept
    return alloc


def _incremental(
    total: int, quota: np.ndarray, caps: np.ndarray, floors: np.ndarray, previous: np.ndarray
) -> np.ndarray | None:
    """Start from the previous division and add (or remove) one replica at a time where the exact quota is
    furthest ahead (behind). Used only while every cluster stays within one replica of its quota, so the
    result is as fair as a fresh division but a small change touches only the clusters it must."""
    alloc = np.minimum(previous, caps)
    step = total - int(alloc.sum())
    if abs(step) > len(alloc):
        return None
    while step > 0:  # argmax/argmin take the first of equals: the earlier cluster in division order
        room = (alloc < caps) & (quota > 0)
        if not room.any():
            return None
        alloc[int(np.argmax(np.where(room, quota - alloc, -np.inf)))] += 1
        step -= 1
    while step < 0:
        over = alloc > floors
        if not over.any():
            return None
        alloc[int(np.argmin(np.where(over, quota - alloc, np.inf)))] -= 1
        step += 1
    if bool((np.abs(alloc - quota) > 1.0 + 1e-9).any()):  # within one replica of its quota: kept
        return None
    return alloc


def divide_even(total: int, caps: np.ndarray, previous: np.ndarray | None = None) -> np.ndarray | None:
    """The common case in O(n): equal weights, no floors and no cap below the even share (same result as the
    water-filling path, which would split evenly and break every remainder tie the same way: the larger
    previous, then the earlier). None when a cap binds."""
    base, rest = divmod(total, len(caps))
    if int(caps.min()) < base + (1 if rest else 0):
        return None
    alloc = np.full(len(caps), base, dtype=np.int64)
    if rest:
        alloc[np.argsort(-previous, kind="stable")[:rest] if previous is not None else slice(0, rest)] += 1
    return alloc


def duplicate(total: int, caps: np.ndarray) -> np.ndarray:
    """Every cluster runs the whole ``total`` (as far as its cap allows)."""
    return np.minimum(total, caps)
