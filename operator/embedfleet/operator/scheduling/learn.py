"""The hub's measured throughput table: embeddings per second of one busy replica, per (model, resource),
smoothed over the spokes' reports. Pure (no I/O): the hub feeds it what each spoke's heartbeat says.

What feeds it: each spoke's heartbeat Lease may carry ``embedfleet.dev/throughput`` (spoke/heartbeat.py),
a compact JSON list of ``{"model": <identity>, "resource": <cpu or GPU type>, "perReplica": <embeddings per
second of one busy replica>}``; `parse` reads it, dropping malformed entries (a bad report never stops a
placement). `Learned.observe` smooths each report into the table with an exponentially weighted moving
average (`ALPHA`): one odd spoke or one unusual minute moves the figure a little, a lasting change moves it
within a few beats. A report is taken once per change of the annotation per spoke, not once per pass, so
the weight of a spoke does not depend on how often the hub reconciles. The table lives in the hub's memory:
a hub that starts (or takes over leadership) takes each spoke's current annotation as it is on its first pass.

The model identity is `model_identity`: the spec's ``model.source`` and, when given, ``@revision``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from embedfleet.operator.scheduling.cost import Throughput

#: Weight of a new report in the smoothed figure.
ALPHA = 0.3
#: Entries kept (each a few dozen bytes); the least recently reported go first beyond it.
MAX_ENTRIES = 4096


def model_identity(source: str, revision: str | None = None) -> str:
    """The key a model's throughput is learned under: the same weights, the same figure on every spoke."""
    return f"{source}@{revision}" if revision else source


def ewma(old: float | None, new: float, alpha: float = ALPHA) -> float:
    """The smoothed figure after one report (the first report is taken as it is)."""
    return new if old is None else old + alpha * (new - old)


def parse(annotation: str | None) -> list[tuple[str, str, float]]:
    """(model, resource, embeddings/s per busy replica) from a heartbeat's throughput annotation; malformed
    entries, zero, negative or non-finite rates are left out."""
    if not annotation:
        return []
    try:
        items = json.loads(annotation)
    except ValueError:
        return []
    out = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        model, resource, rate = item.get("model"), item.get("resource"), item.get("perReplica")
        if not (isinstance(model, str) and model and isinstance(resource, str) and resource):
            continue
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            continue
        out.append((model, resource, float(rate)))
    return out


def annotation(entries: list[tuple[str, str, float]]) -> str:
    """The annotation a spoke writes for its measurements (the inverse of `parse`). Figures keep six
    significant digits, not decimal places: a slow model's rate (0.0019 inputs/s) must read back within a
    fraction of a percent, or the spoke would see its own write as a change and rewrite it every beat."""
    return json.dumps([{"model": m, "resource": r, "perReplica": float(f"{v:.6g}")} for m, r, v in sorted(entries)],
                      separators=(",", ":"))


@dataclass
class Learned:
    """The smoothed table, and per spoke the last annotation taken (so a report counts once)."""

    rates: dict[tuple[str, str], float] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)

    def observe(self, spoke: str, annotation_value: str | None) -> bool:
        """Take a spoke's current report; True when the table changed."""
        if not annotation_value or self.seen.get(spoke) == annotation_value:
            return False
        self.seen[spoke] = annotation_value
        changed = False
        for model, resource, rate in parse(annotation_value):
            key = (model, resource)
            old = self.rates.pop(key, None)  # re-inserted last: the dict's order is recency
            self.rates[key] = ewma(old, rate)
            changed = True
        while len(self.rates) > MAX_ENTRIES:
            del self.rates[next(iter(self.rates))]
        return changed

    def observe_all(self, reports: Mapping[str, Any]) -> None:
        """``reports``: spoke -> its annotation value (None: it reports nothing)."""
        for spoke, value in sorted(reports.items()):
            self.observe(spoke, value)

    def throughput(self) -> Throughput:
        """A snapshot for one ``place`` call."""
        return Throughput(dict(self.rates))
