"""Replica division: a total over clusters by weight, under per-cluster floors and caps.

Floors are granted first, the rest is split by weight with water-filling (a cluster whose share would
exceed its cap is fixed at the cap and the others share what is left), then rounded with the largest
remainder method. Ties on the remainder go to the cluster that had more replicas before, then to the
better score's order, so rounding never flips between equal clusters from one run to the next.

Stability: shares are proportional to static weights, so a small change of the total moves only the
clusters whose rounded share changes (about the change itself, spread over the largest remainders),
never a reshuffle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


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
    floors = floors or {}
    previous = previous or {}
    if not floors and names:
        fast = _even_uncapped(total, names, weights, caps, previous)
        if fast is not None:
            return fast
    alloc = {n: min(floors.get(n, 0), caps.get(n, 0)) for n in names}
    remaining = total - sum(alloc.values())
    if remaining <= 0:
        return alloc
    room = {n: caps.get(n, 0) - alloc[n] for n in names}
    free = [n for n in names if weights.get(n, 0) > 0 and room[n] > 0]
    share: dict[str, float] = {}
    left = float(remaining)
    while free:
        weight_sum = sum(weights[n] for n in free)
        over = [n for n in free if left * weights[n] / weight_sum >= room[n]]
        if not over:
            for n in free:
                share[n] = left * weights[n] / weight_sum
            break
        for n in over:
            share[n] = float(room[n])
            left -= room[n]
        free = [n for n in free if n not in over]
        if left <= 0:
            break
    whole = {n: min(room[n], math.floor(s + 1e-9)) for n, s in share.items()}
    quota = {n: alloc[n] + share.get(n, 0.0) for n in names}
    for n, w in whole.items():
        alloc[n] += w
    rest = remaining - sum(whole.values())
    if rest > 0:
        rank = {n: i for i, n in enumerate(names)}
        order = sorted(
            (n for n in share if whole[n] < room[n]),
            key=lambda n: (-(share[n] - whole[n]), -previous.get(n, 0), rank[n]),
        )
        for n in order[:rest]:
            alloc[n] += 1
    if previous:
        kept = _incremental(sum(alloc.values()), names, quota, caps, floors, previous)
        if kept is not None:
            return kept
    return alloc


def _incremental(
    total: int, names: Sequence[str], quota: Mapping[str, float], caps: Mapping[str, int],
    floors: Mapping[str, int], previous: Mapping[str, int],
) -> dict[str, int] | None:
    """Start from the previous division and add (or remove) one replica at a time where the exact quota is
    furthest ahead (behind). Used only while every cluster stays within one replica of its quota, so the
    result is as fair as a fresh division but a small change touches only the clusters it must."""
    alloc = {n: min(previous.get(n, 0), caps.get(n, 0)) for n in names}
    step = total - sum(alloc.values())
    if abs(step) > len(names):
        return None
    rank = {n: i for i, n in enumerate(names)}
    while step > 0:
        room = [n for n in names if alloc[n] < caps.get(n, 0) and quota[n] > 0]
        if not room:
            return None
        best = max(room, key=lambda n: (quota[n] - alloc[n], -rank[n]))
        alloc[best] += 1
        step -= 1
    while step < 0:
        over = [n for n in names if alloc[n] > floors.get(n, 0)]
        if not over:
            return None
        worst = min(over, key=lambda n: (quota[n] - alloc[n], rank[n]))
        alloc[worst] -= 1
        step += 1
    if any(abs(alloc[n] - quota[n]) >= 1.0 for n in names):
        return None
    return alloc


def _even_uncapped(
    total: int, names: Sequence[str], weights: Mapping[str, float], caps: Mapping[str, int],
    previous: Mapping[str, int],
) -> dict[str, int] | None:
    """The common case in O(n): equal weights and no cap below the even share (same result as the general
    path, which would split evenly and break every remainder tie the same way)."""
    first = weights.get(names[0], 0)
    if first <= 0 or any(weights.get(n, 0) != first for n in names):
        return None
    base, rest = divmod(total, len(names))
    need = base + (1 if rest else 0)
    if any(caps.get(n, 0) < need for n in names):
        return None
    alloc = dict.fromkeys(names, base)
    if rest:
        if previous:
            rank = {n: i for i, n in enumerate(names)}
            order = sorted(names, key=lambda n: (-previous.get(n, 0), rank[n]))
        else:
            order = list(names)
        for n in order[:rest]:
            alloc[n] += 1
    return alloc


def duplicate(total: int, names: Sequence[str], caps: Mapping[str, int]) -> dict[str, int]:
    """Every cluster runs the whole ``total`` (as far as its cap allows)."""
    return {n: min(total, caps.get(n, 0)) for n in names}
