"""Cost per million embeddings: what one replica of a model costs for the work it does on a resource. Pure.

``cost = price per replica-hour / embeddings per replica-hour * 1e6``. The price is what a FleetCluster
declares (per GPU, or per CPU replica slot); the throughput is either *measured* (the runtimes' own count
of embeddings per busy second, reported by the spokes and smoothed by the hub: learn.py) or, until there is
a measurement for this (model, resource), a *prior* from the model's size and a table of accelerator speeds.

Why a size-based prior and not the hourly price alone: a GPU that costs ten times a CPU slot may embed a
thousand times as fast for a 7B decoder, and no faster than a few CPU slots for a 22M MiniLM, whose
replicas are bound by the host path (tokenizing, HTTP, pooling), not by the accelerator. The prior models
that with two terms per embedding: a fixed host cost per resource and a compute cost proportional to the
parameters, divided by the resource's relative speed::

    seconds per embedding = HOST_SECONDS[resource] + params / (SPEED[resource] * H100_PARAMS_PER_SECOND)

The numbers are deliberately round, order-of-magnitude figures (an H100 embeds about 2,200 short texts a
second with a 110M-parameter encoder; a CPU replica slot about 1/125 of the H100's compute): the prior only
has to rank clusters until the fleet has measured them, and every status line says ``prior`` until then.

The model's size comes from its name when the name says it (``0.6B``, ``335M``, ``-small``, ``-base``,
``-large``, ``MiniLM``), else `DEFAULT_PARAMS`: the spec carries no parameter count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from embedfleet.operator.scheduling.model import CPU

#: Relative compute speed per unit (one GPU, or one CPU replica slot), nvidia-h100 = 1.
SPEED: Mapping[str, float] = {
    "nvidia-b200": 2.0,
    "nvidia-h200": 1.15,
    "nvidia-h100": 1.0,
    "nvidia-a100-80gb": 0.55,
    "nvidia-a100-40gb": 0.5,
    "nvidia-l40s": 0.45,
    "nvidia-a10g": 0.2,
    "nvidia-l4": 0.18,
    "nvidia-t4": 0.08,
    CPU: 0.008,
}
#: Speed of a GPU type missing from `SPEED` (a conservative guess: an L4's).
UNKNOWN_GPU_SPEED = 0.18
#: Parameter-embeddings per second of one nvidia-h100 (110M parameters x 4,000 embeddings/s of compute).
H100_PARAMS_PER_SECOND = 4.4e11
#: Fixed host-side seconds per embedding of one replica: a GPU replica's host path caps it near 5,000/s.
GPU_HOST_SECONDS = 2e-4
CPU_HOST_SECONDS = 5e-4
#: Size of a model whose name says nothing (a BERT-base-sized encoder).
DEFAULT_PARAMS = 110e6
#: Sizes the usual names imply.
NAMED_SIZES: tuple[tuple[str, float], ...] = (
    ("minilm", 22e6), ("tiny", 5e6), ("small", 33e6), ("base", 110e6), ("large", 335e6), ("xl", 1.5e9),
)
_SIZE = re.compile(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)([bm])(?![a-z])")
SECONDS_PER_HOUR = 3600.0


def params_from_name(model: str) -> float:
    """The parameter count a model's name implies (its last path segment, e.g. ``Qwen3-Embedding-0.6B`` ->
    0.6e9, ``bge-small-en-v1.5`` -> 33e6), else `DEFAULT_PARAMS`."""
    name = model.rstrip("/").rsplit("/", 1)[-1].split("@", 1)[0].lower()
    name = re.sub(r"[-_]", " ", name)
    found = _SIZE.search(name)
    if found:
        value = float(found.group(1)) * (1e9 if found.group(2) == "b" else 1e6)
        if value > 0:
            return value
    for word, size in NAMED_SIZES:
        if word in name:
            return size
    return DEFAULT_PARAMS


def prior_rate(resource: str, params: float) -> float:
    """Embeddings per second of one unit of ``resource`` (a GPU of that type, or a CPU slot) for a model of
    ``params`` parameters: the prior (module docstring)."""
    speed = SPEED.get(resource, UNKNOWN_GPU_SPEED)
    host = CPU_HOST_SECONDS if resource == CPU else GPU_HOST_SECONDS
    return 1.0 / (host + max(params, 1.0) / (speed * H100_PARAMS_PER_SECOND))


def cost_per_million(hourly_price: float, rate: float) -> float:
    """Dollars per million embeddings from a price per hour and embeddings per second (of the same thing:
    one unit, or one replica). A rate of 0 or less costs infinity; a price of 0 costs 0."""
    if rate <= 0 or not math.isfinite(rate):
        return math.inf
    return hourly_price / (rate * SECONDS_PER_HOUR) * 1e6


@dataclass(frozen=True, slots=True)
class Throughput:
    """What the fleet has measured: (model identity, resource) -> embeddings per second of one busy replica,
    as the hub's smoothed table holds it (learn.py). Empty: every rate is the prior."""

    measured: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def unit_rates(self, model: str, per_replica: int, resources: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings per second of one unit, was it measured) per resource: a measured replica's rate is
        spread over its ``per_replica`` GPUs (a CPU replica is one unit), so ``price per unit / rate per
        unit`` is the replica's cost per embedding."""
        params = params_from_name(model)
        rates = np.empty(len(resources))
        measured = np.zeros(len(resources), dtype=bool)
        for j, resource in enumerate(resources):
            seen = self.measured.get((model, resource))
            if seen is not None and seen > 0 and math.isfinite(seen):
                rates[j] = seen / (1 if resource == CPU else max(1, per_replica))
                measured[j] = True
            else:
                rates[j] = prior_rate(resource, params)
        return rates, measured


def cost_array(price: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """`cost_per_million` elementwise (the same operations, so equal inputs give bit-equal costs)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = price / (rate * SECONDS_PER_HOUR) * 1e6
    return np.where(rate > 0, out, np.inf)

