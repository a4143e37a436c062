"""Requests held for a deployment that has no replica able to take them (a cold start).

Pure bookkeeping: a bounded queue kept interactive requests first, then in arrival order (classes.py:
a query is never queued behind bulk work). A request is admitted while there is room, refused past
the bound, taken out when it gives up (its hold timed out or its client left), and all of them are
released in that order when a replica becomes ready. A request that goes back to the queue (its
replica failed before answering) keeps its place by its class and arrival number.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Held(Generic[T]):
    arrival: int  # the gateway's arrival counter: the order of release within a class
    since: float  # time.monotonic() when it was first held
    item: T  # what the caller waits on (a future)
    bulk: bool = False  # released after every interactive request held
    owner: object = None  # the caller's record of the request (fleet.py: its Ticket, which says where it may go)

    @property
    def order(self) -> tuple[bool, int]:
        return self.bulk, self.arrival


def _order(held: Held) -> tuple[bool, int]:
    return held.order


class HeldQueue(Generic[T]):
    def __init__(self, bound: int) -> None:
        if bound < 0:
            raise ValueError("bound must be >= 0")
        self.bound = bound
        self._held: list[Held[T]] = []

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Held[T]]:
        return iter(self._held)

    @property
    def full(self) -> bool:
        return len(self._held) >= self.bound

    def oldest(self) -> Held[T] | None:
        """The request held longest, whatever its class (how long the deployment has been cold)."""
        return min(self._held, key=lambda h: h.since, default=None)

    def admit(self, held: Held[T]) -> bool:
        """Hold `held` in its place (class, then arrival); False (and nothing held) when the queue is full."""
        if self.full:
            return False
        bisect.insort(self._held, held, key=_order)
        return True

    def remove(self, held: Held[T]) -> bool:
        """Take out a request that gave up; False when it was not held (already released)."""
        i = bisect.bisect_left(self._held, held.order, key=_order)
        if i < len(self._held) and self._held[i] is held:
            del self._held[i]
            return True
        try:
            self._held.remove(held)  # equal arrival numbers (only if a caller reuses one)
        except ValueError:
            return False
        return True

    def release(self, n: int | None = None) -> list[Held[T]]:
        """The first `n` (all when None) in release order (interactive first, then oldest first); they are
        no longer held."""
        n = len(self._held) if n is None else max(0, n)
        out, self._held = self._held[:n], self._held[n:]
        return out
