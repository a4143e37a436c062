"""No cyclic garbage collection while a server starts; what the start made is frozen once it is ready.

A start imports torch and the web stack and loads the model: about 340,000 objects the collector tracks,
nearly all of which live as long as the process. Each collection of the older generations walks all of
them again, and a start triggers many: on two cores they were about a quarter of a second of the default
model's start (`bench/serve_start.py`). What they found was under a megabyte of cycles (import-time
tuples, cells and functions; no array or tensor), so the start runs without them (`hold`), and once the
server is ready, or its start has failed, everything alive is moved to the permanent generation
(`gc.freeze`) and collection resumes (`release`): later collections walk only what was made after, and
the start's few cycles stay where they are (the price: that memory, once).

`hold` is a no-op where the collector is already off (a caller that manages it itself), and so is the
`release` that follows it.
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
