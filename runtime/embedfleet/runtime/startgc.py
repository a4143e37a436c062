"""Rare cyclic garbage collection while a server starts; what the start made is frozen once it is ready.

A start imports torch and the web stack and loads the model: hundreds of thousands of objects the collector
tracks, nearly all of which live as long as the process. At Python's default thresholds (a collection every
700 allocations) a start runs many collections, each walking the young objects again and the older ones
often, to find few cycles (import-time tuples, cells and functions). So while the server starts the first
threshold is raised (`hold`: a collection every START_THRESHOLD allocations, which still bounds what cycles
a long start, such as the int8 build's, can pile up), and once the server is ready, or its start has failed,
everything alive is moved to the permanent generation (`gc.freeze`) and the thresholds are put back
(`release`): later collections walk only what was made after, and the cycles made since the start's last
collection stay where they are (the price: that memory, once; tests/runtime/test_startgc.py bounds it). What
it saves is in docs/performance.md (Start-up).

`hold` is a no-op where the collector is off (a caller that manages it itself), and so is the `release` that
follows it. A standby parent (standby.py) and a split server's supervisor release at once, as they live as
long as the pod; a standby parent's server holds again for its own start.
"""

from __future__ import annotations

import gc

START_THRESHOLD = 100_000  # allocations between two collections while a server starts (Python's default: 700)
_saved: tuple[int, int, int] | None = None


def hold() -> None:
    """Collect rarely until `release`."""
    global _saved
    if gc.isenabled() and _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(START_THRESHOLD, 50, 50)


def release() -> None:
    """Freeze what is alive and put the thresholds back, if `hold` raised them; later calls do nothing."""
    global _saved
    if _saved is not None:
        saved, _saved = _saved, None
        gc.freeze()
        gc.set_threshold(*saved)


def held() -> bool:
    return _saved is not None
