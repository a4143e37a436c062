"""What this spoke's runtimes measurably deliver: embeddings per second of one busy replica, per (model, resource).

The hub ranks clusters by cost per million embeddings (scheduling/cost.py) and learns the rate it divides by
from each spoke's heartbeat annotation ``embedfleet.dev/throughput`` (scheduling/learn.py: the format). This
module is where that figure comes from:

* the autoscale daemon already scrapes every Ready runtime pod each tick (signals.py); the same scrape reads
  the runtime's counters ``embedfleet_inputs_total`` and ``embedfleet_engine_busy_seconds_total``;
* `advance` (pure) turns two scrapes into a window per pod: inputs and busy seconds since that pod's
  baseline. Inputs per *busy* second is the replica's rate at full use whatever its load, so an idle fleet
  and a saturated one report the same figure. A counter that went down (the runtime restarted) starts a new
  baseline and gives nothing; a pod with fewer than ``min_inputs`` inputs or less than ``min_busy_s`` busy
  seconds since its baseline gives nothing yet (its baseline stays, so light traffic adds up over ticks);
* `Registry` keeps, per EmbeddingDeployment, its last few windows, in the operator's memory: the daemon
  records, the heartbeat reads, in the same process (the spoke's kopf startup handler makes one and hands it
  to both through kopf's memo);
* `aggregate` (pure) sums them per (model identity, resource) into at most `MAX_ENTRIES` figures, and
  `noticeable` (pure) says whether they differ enough (`CHANGE`) from what the Lease carries to be written:
  the Lease is not rewritten every beat for noise.

Only the direct scrape feeds it: a deployment whose autoscaler reads Prometheus (or that has autoscaling
off) makes no per-pod scrape with counters, so it reports nothing and the hub keeps its prior for it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from embedfleet.operator.scheduling import learn
from embedfleet.operator.scheduling.cost import CPU

#: A window with fewer inputs, or fewer busy seconds, than these says too little to be a rate.
MIN_INPUTS = 32
MIN_BUSY_S = 1.0
#: Windows kept per deployment (its figure is their total inputs over their total busy seconds).
WINDOWS_KEPT = 8
#: A deployment that gave no window for this long (deleted, or idle for hours) is no longer reported.
MAX_AGE_S = 6 * 3600.0
#: Entries in the annotation; beyond it the (model, resource) pairs with the fewest busy seconds are left out.
MAX_ENTRIES = 32
#: Smallest figure reported (embeddings per busy second): the annotation's precision.
MIN_RATE = 1e-3
#: Relative change of some figure that is worth rewriting the Lease for.
CHANGE = 0.05


@dataclass(frozen=True)
class Counters:
    """One pod's engine counters as scraped (cumulative since the runtime started)."""

    inputs: float
    busy_s: float


@dataclass(frozen=True)
class Window:
    """Inputs and busy seconds over some span: their ratio is embeddings per busy second."""

    inputs: float
    busy_s: float

    @property
    def rate(self) -> float:
        return self.inputs / self.busy_s


def advance(baselines: Mapping[str, Counters], current: Mapping[str, Counters], min_inputs: float = MIN_INPUTS,
            min_busy_s: float = MIN_BUSY_S) -> tuple[dict[str, Counters], Window | None]:
    """(each pod's baseline for the next scrape, the window this scrape completes, or None).

    ``current``: the pods that answered with both counters. A pod not in it is forgotten (a pod that comes
    back starts afresh). A new pod, or one whose counter went down (a restart), only sets its baseline. A pod
    whose growth since its baseline reaches both minimums contributes that growth and moves its baseline to
    now; one that does not keeps its baseline, so its inputs add up until they do.
    """
    kept: dict[str, Counters] = {}
    inputs = busy = 0.0
    for pod, now in current.items():
        base = baselines.get(pod)
        if base is None or now.inputs < base.inputs or now.busy_s < base.busy_s:
            kept[pod] = now
            continue
        d_inputs, d_busy = now.inputs - base.inputs, now.busy_s - base.busy_s
        if d_inputs >= min_inputs and d_busy >= min_busy_s:
            inputs += d_inputs
            busy += d_busy
            kept[pod] = now
        else:
            kept[pod] = base
    return kept, (Window(inputs, busy) if busy > 0 else None)


def resource_of(gpu_count: int, gpu_type: str | None) -> str | None:
    """The resource name the hub's cost table uses: ``cpu`` without GPUs, else the spec's GPU type; None for
    GPUs of no named type (the figure could not be told apart from another GPU's)."""
    if gpu_count <= 0:
        return CPU
    return gpu_type or None


@dataclass(frozen=True)
class Measured:
    """One deployment's figure: what it serves, on what, and its recent windows summed."""

    model: str
    resource: str
    window: Window
    at: float


def aggregate(measured: Iterable[Measured], max_entries: int = MAX_ENTRIES) -> list[tuple[str, str, float]]:
    """(model, resource, embeddings per busy second) over every deployment serving that model on that
    resource: their inputs over their busy seconds. At most ``max_entries``, the best measured (most busy
    seconds) first chosen; sorted, so the same figures always make the same annotation."""
    sums: dict[tuple[str, str], list[float]] = {}
    for m in measured:
        if m.window.busy_s <= 0 or m.window.inputs <= 0:
            continue
        acc = sums.setdefault((m.model, m.resource), [0.0, 0.0])
        acc[0] += m.window.inputs
        acc[1] += m.window.busy_s
    # below the annotation's precision (learn.annotation rounds to 1e-3) a figure would read as no figure
    usable = {k: v for k, v in sums.items() if math.isfinite(v[0] / v[1]) and v[0] / v[1] >= MIN_RATE}
    chosen = sorted(usable.items(), key=lambda kv: (-kv[1][1], kv[0]))[:max_entries]
    return sorted((model, resource, inputs / busy) for (model, resource), (inputs, busy) in chosen)


def noticeable(written: str | None, entries: list[tuple[str, str, float]], change: float = CHANGE) -> bool:
    """Whether ``entries`` should replace the annotation as written: never for nothing measured (a beat never
    removes it), always when a (model, resource) appeared or went, else when some figure moved by more than
    ``change`` of itself."""
    if not entries:
        return False
    old = {(m, r): v for m, r, v in learn.parse(written)}
    new = {(m, r): v for m, r, v in entries}
    if old.keys() != new.keys():
        return True
    return any(abs(new[k] - old[k]) > change * old[k] for k in new)


class Registry:
    """Per EmbeddingDeployment (``namespace/name``), its last `WINDOWS_KEPT` windows; thread-safe (the daemon
    records from a worker thread, the heartbeat reads from its own)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._lock = threading.Lock()
        self._clock = clock or time.monotonic
        self._by_deployment: dict[str, tuple[str, str, deque[Window], float]] = {}

    def record(self, deployment: str, model: str, resource: str, window: Window) -> None:
        """Add a window; a change of model or resource (a new revision, another GPU) starts the deployment over."""
        now = self._clock()
        with self._lock:
            old = self._by_deployment.get(deployment)
            windows = old[2] if old is not None and old[:2] == (model, resource) else deque(maxlen=WINDOWS_KEPT)
            windows.append(window)
            self._by_deployment[deployment] = (model, resource, windows, now)

    def forget(self, deployment: str) -> None:
        with self._lock:
            self._by_deployment.pop(deployment, None)

    def measured(self) -> list[Measured]:
        """Each deployment's figure, leaving out (and dropping) those with no window for `MAX_AGE_S`."""
        now = self._clock()
        with self._lock:
            for key in [k for k, v in self._by_deployment.items() if now - v[3] > MAX_AGE_S]:
                del self._by_deployment[key]
            return [Measured(model, resource, Window(sum(w.inputs for w in ws), sum(w.busy_s for w in ws)), at)
                    for model, resource, ws, at in self._by_deployment.values()]

    def entries(self) -> list[tuple[str, str, float]]:
        """What the heartbeat reports: `aggregate` over every deployment."""
        return aggregate(self.measured())
