"""No cyclic garbage collection while a server starts; what the start made is frozen once it is ready.

A start imports torch and the web stack and loads the model: hundreds of thousands of objects the collector
tracks, nearly all of which live as long as the process. Each collection of the older generations walks all
of them again, and a start triggers many, to find few cycles (import-time tuples, cells and functions). So the
start runs without them (`hold`), and once the server is ready, or its start has failed, everything alive is
moved to the permanent generation (`gc.freeze`) and collection resumes (`release`): later collections walk
only what was made after, and the start's cycles stay where they are (the price: that memory, once;
tests/runtime/test_startgc.py bounds it). What it saves is in docs/performance.md (Start-up).

`hold` is a no-op where the collector is already off (a caller that manages it itself), and so is the
`release` that follows it. A standby parent (standby.py) and a split server's supervisor release at once:
they live as long as the pod and start nothing of their own.
"""

from __future__ import annotations

import gc

_held = False


def hold() -> None:
    """Turn the collector off until `release`."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release() -> None:
    """Freeze what is alive and turn the collector back on, if `hold` turned it off; later calls do nothing."""
    global _held
    if _held:
        _held = False
        gc.freeze()
        gc.enable()


def held() -> bool:
    return _held
