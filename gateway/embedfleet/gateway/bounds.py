"""A deployment's own shed and spill bounds, and which one applies: its own, else the gateway's flag.

On Kubernetes each EmbeddingDeployment may set `spec.runtime.maxQueueSeconds`,
`spec.runtime.maxQueueSecondsBulk` (the same bounds its runtime pods are given, so the gateway says no
where the runtime would) and `spec.placement.spillAfterSeconds`; kube.py reads them. In static mode
`--bounds NAME=maxQueueSeconds=...` sets the same three by name (`from_flag`). Unset, the gateway's
`--max-queue-seconds`, `--max-queue-seconds-bulk` and `--spill-after` apply.
Each answer names where its value came from, so a refusal's message points at what to change.

Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embedfleet.gateway.config import GatewayConfig


@dataclass(frozen=True, slots=True)
class Bounds:
    """A deployment's own bounds, in seconds; None: the gateway's flag."""

    max_queue_s: float | None = None
    max_queue_bulk_s: float | None = None
    spill_after_s: float | None = None
    origin: str = ""  # where they were set, for messages: "" the EmbeddingDeployment's spec, else the flag


@dataclass(frozen=True, slots=True)
class Bound:
    seconds: float
    source: str  # the flag or spec field it came from (named in messages)


def _seconds(value: object) -> float | None:
    """A finite number >= 0, else None (the API server's schema already refuses the rest; a value that
    slips through falls back to the flag rather than turning shedding or spill off by accident)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def from_object(obj: Mapping[str, Any]) -> Bounds:
    """An EmbeddingDeployment (as the API server sends it) -> its own bounds."""
    spec = obj.get("spec") or {}
    runtime, placement = spec.get("runtime") or {}, spec.get("placement") or {}
    return Bounds(_seconds(runtime.get("maxQueueSeconds")), _seconds(runtime.get("maxQueueSecondsBulk")),
                  _seconds(placement.get("spillAfterSeconds")))


def from_flag(name: str, fields: Mapping[str, float]) -> Bounds:
    """`--bounds NAME=...` (config.parse_bounds, already checked) -> NAME's own bounds."""
    return Bounds(_seconds(fields.get("maxQueueSeconds")), _seconds(fields.get("maxQueueSecondsBulk")),
                  _seconds(fields.get("spillAfterSeconds")), origin=f"--bounds {name}=")


def _source(bounds: Bounds, spec_field: str) -> str:
    return f"{bounds.origin}{spec_field.rsplit('.', 1)[1]}" if bounds.origin else spec_field


def shed_bound(bounds: Bounds, config: GatewayConfig, bulk: bool) -> Bound:
    """The expected wait over which a request of this class is refused (0: never)."""
    if bulk:
        if bounds.max_queue_bulk_s is not None:
            return Bound(bounds.max_queue_bulk_s, _source(bounds, "spec.runtime.maxQueueSecondsBulk"))
        return Bound(config.max_queue_seconds_bulk, "--max-queue-seconds-bulk")
    if bounds.max_queue_s is not None:
        return Bound(bounds.max_queue_s, _source(bounds, "spec.runtime.maxQueueSeconds"))
    return Bound(config.max_queue_seconds, "--max-queue-seconds")


def spill_after(bounds: Bounds, config: GatewayConfig) -> Bound:
    """The expected wait here over which a request goes to another region (spill.py)."""
    if bounds.spill_after_s is not None:
        return Bound(bounds.spill_after_s, _source(bounds, "spec.placement.spillAfterSeconds"))
    return Bound(config.spill_after, "--spill-after")
