"""Two servers' answers compared as a client reads them: status, shape, text and integers exactly; vectors
and scores to float32 rounding.

The same input can round differently in its last bit when it runs in another batch (a bulk request is cut
into batches by the measured drain rate, which differs from process to process) or on another number of
threads (an engine on its share of the cores): a matrix product summed in another order. So "the same
answer" is: everything but floats identical, floats within FLOAT_TOL (of the vector's scale), and
int8-quantized vectors within one step, which such a difference can move across a rounding boundary.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import httpx
import numpy as np

FLOAT_TOL = 1e-5  # of the vector's largest component (at least 1): float32 summed in another order, through
# every layer, moves components by tens of units in the last place; a wrong vector moves them by far more


def _vector(value: Any) -> np.ndarray | None:
    if isinstance(value, str):
        try:
            return np.frombuffer(base64.b64decode(value, validate=True), dtype="<f4")
        except ValueError:
            return None
    if isinstance(value, list) and value and all(isinstance(x, int | float) and not isinstance(x, bool)
                                                 for x in value):
        return np.asarray(value, dtype=np.float64)
    return None


def _same(got: Any, want: Any, path: str) -> str | None:
    """None when `got` is `want` as above, else where they differ first."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return f"{path}: keys {sorted(got) if isinstance(got, dict) else type(got)} != {sorted(want)}"
        return next((d for k in want if (d := _same(got[k], want[k], f"{path}.{k}")) is not None), None)
    if path.endswith(".embedding") or (isinstance(want, list) and want and isinstance(want[0], float)):
        kinds = [type(x) for x in want] if isinstance(want, list) else None
        if type(got) is not type(want) or (kinds is not None and [type(x) for x in got] != kinds):
            return f"{path}: a {type(got).__name__} of other kinds where a {type(want).__name__} was"
        a, b = _vector(got), _vector(want)
        if a is None or b is None or a.shape != b.shape:
            return f"{path}: not the same kind of vector"
        scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
        step = 1.0 if isinstance(want, list) and all(isinstance(x, int) for x in want) else FLOAT_TOL * scale
        worst = float(np.max(np.abs(a - b))) if a.size else 0.0
        return None if worst <= step else f"{path}: differs by {worst}"
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{path}: length {len(got) if isinstance(got, list) else type(got)} != {len(want)}"
        return next((d for i, (g, w) in enumerate(zip(got, want, strict=True))
                     if (d := _same(g, w, f"{path}[{i}]")) is not None), None)
    if isinstance(want, float) and isinstance(got, float):
        return None if math.isclose(got, want, rel_tol=0, abs_tol=FLOAT_TOL) else f"{path}: {got} != {want}"
    return None if (type(got), got) == (type(want), want) else f"{path}: {got!r} != {want!r}"


def assert_same_answer(got: httpx.Response, want: httpx.Response, context: object = None) -> None:
    assert got.status_code == want.status_code, (context, got.status_code, want.status_code, got.text[:300])
    try:
        got_body, want_body = json.loads(got.content), json.loads(want.content)
    except ValueError:
        assert got.content == want.content, (context, got.text[:300])
        return
    difference = _same(got_body, want_body, "$")
    assert difference is None, (context, difference)
