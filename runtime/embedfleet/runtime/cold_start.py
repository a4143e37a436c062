"""This process's cold start, phase by phase, as only the process itself can see it.

The operator sees a runtime pod from the outside (created, scheduled, containers started, Ready:
operator/embedfleet/operator/cold_start.py); what happens inside the container it cannot see. This
module records that part, for one process:

* ``weights``: how long the weights took to arrive where they are loaded from, and from where
  (``WeightsSource``, read from the directory by `classify_weights`);
* ``weights_verify``: the check of the weights against ``--model-digest`` (one read of every byte);
* ``engine_load``: reading the model directory and building the engine; for engines that build something
  from the weights (int8, TensorRT-LLM), also where that build came from (``built`` here, ``cache``: made
  earlier on this node, ``peer``: copied from another node by the node agent) and its folder
  (engines/cache_dir.py `BuildSource`);
* ``warmup``: everything after that until the model serves (warm-up batches, GPU batch sizing, the
  drain-rate seed; the start-up probe only with --probe-reference: otherwise it runs after the start);
* ``ready``: from process start to every model serving (interpreter start and imports included);
* ``first_request``: from process start to the first request answered with a 2xx.

The first four are parts (per model where there are several); the last two are totals from process
start. They go out as the histogram ``embedfleet_cold_start_seconds{phase}`` (one observation per phase
and model; a histogram rather than a gauge because the operator exports its pod-level phases under the
same name and type, so one dashboard query aggregates both over a fleet, and a replica that is gone still
counted in the range it was scraped in), as ``embedfleet_weights_source_info{model,source}`` and
``embedfleet_engine_source_info{model,source}``, and as the
``startup`` section of ``GET /load`` (`ColdStart.report`), which the operator reads when the pod turns
Ready, the way it already reads the pods' /metrics.

Process start comes from the kernel (``/proc/self/stat``), so interpreter start-up and imports count;
where that cannot be read, from when this recorder was made.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge, Histogram

if TYPE_CHECKING:
    from embedfleet.runtime.engines.cache_dir import BuildSource

log = logging.getLogger(__name__)

#: Written by ``embedfleet cache pull`` next to ``.ready`` (the pod's own copy, or the node cache's entry):
#: where those weights came from and how long fetching them took. Same name as the cache's SOURCE_RECORD;
#: spelled out here because the runtime must not depend on the cache package for it.
SOURCE_RECORD = ".source.json"
#: The cache's marker of a verified entry (operator/cache/digest.py READY_MARKER).
READY_MARKER = ".ready"
#: Where weights can come from. From a cache record: ``cache`` (the node's copy), ``peer`` (another
#: node's agent), ``origin`` (the model's source). Classified here when there is no record: ``cache``
#: (a link to a verified node cache entry), ``downloaded`` (a verified entry of the pod's own: the init
#: container fetched it, from where is unknown), ``in-image`` (a directory found in place: in the image,
#: on a mounted volume, or any local directory outside Kubernetes).
RECORD_SOURCES = ("cache", "peer", "origin")
SOURCES = (*RECORD_SOURCES, "downloaded", "in-image")
PHASES = ("weights", "weights_verify", "engine_load", "warmup", "ready", "first_request")
#: Shared with the operator's histogram of the same name (operator/embedfleet/operator/metrics.py).
BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


@dataclass(frozen=True)
class WeightsSource:
    """Where one model's weights came from, and the seconds that took (None when unknown)."""

    source: str
    seconds: float | None
    #: For a node cache hit whose entry carries a record: how the node got it (``peer``, ``origin``).
    cached_from: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "seconds": self.seconds}
        if self.cached_from is not None:
            out["cached_from"] = self.cached_from
        return out


def parse_record(text: str | None) -> tuple[str, float | None] | None:
    """(source, seconds) of a ``.source.json`` text, or None when it is absent or malformed.

    Tolerant on purpose: the record is written by another component and only informs a report, so a
    record that is not JSON, not an object, names an unknown source or a seconds value that is not a
    finite non-negative number is ignored (seconds alone may be missing)."""
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("source") not in RECORD_SOURCES:
        return None
    seconds = doc.get("seconds")
    if seconds is None:
        return doc["source"], None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds < 0:
        return None
    return doc["source"], float(seconds)


def classify_weights(is_link: bool, verified: bool, beside: str | None, inside: str | None) -> WeightsSource:
    """Where a model directory's weights came from (pure: `read_weights_source` gathers the inputs).

    ``is_link``: the directory is a symlink (how ``cache pull --from-node-cache`` hands a pod the node's
    entry); ``verified``: its target holds the cache's ``.ready``; ``beside``: the text of a record next
    to the directory (``<dir>.source.json``, this pod's own account), ``inside``: of the record in it.

    A record beside the directory wins. A link to a verified entry is a node cache hit: the pod waited
    for no download (0 s; the record inside, if any, says how the node got it). A verified entry that is
    not a link was pulled for this pod: its record says from where and how long, else ``downloaded``,
    time unknown. Anything else was already in place: ``in-image``, nothing fetched."""
    own = parse_record(beside)
    if own is not None:
        return WeightsSource(*own)
    found = parse_record(inside)
    if is_link and verified:
        return WeightsSource("cache", 0.0, found[0] if found is not None and found[0] != "cache" else None)
    if verified:
        return WeightsSource(*found) if found is not None else WeightsSource("downloaded", None)
    return WeightsSource("in-image", 0.0)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[:4096]
    except OSError:
        return None


def read_weights_source(path: Path) -> WeightsSource:
    """`classify_weights` of a model directory on disk (a few small reads; never raises)."""
    path = Path(path)
    return classify_weights(path.is_symlink(), (path / READY_MARKER).is_file(),
                            _read(path.with_name(path.name + SOURCE_RECORD)), _read(path / SOURCE_RECORD))


#: Set by a standby parent (standby.py) for its first server: when the parent started (Unix seconds), so
#: that the first start's phases include the imports the parent did for it.
STARTED_ENV = "_EMBEDFLEET_PROCESS_STARTED"


def process_age_s() -> float | None:
    """Seconds since this process started, by the kernel's clock: ``/proc/self/stat``'s start time (clock
    ticks since boot) against CLOCK_BOOTTIME, the clock it is counted on. None off Linux. A standby
    parent's first server counts from the parent's start (STARTED_ENV)."""
    given = os.environ.get(STARTED_ENV)
    if given:
        try:
            return max(0.0, time.time() - float(given))
        except ValueError:
            pass
    try:
        stat = Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class ModelStart:
    weights: WeightsSource | None = None
    engine: BuildSource | None = None  # engines that build something: where the build came from
    engine_load: float | None = None
    warmup: float | None = None


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class ColdStart:
    """Records the phases of this process's start as they happen (from the load task, the engine's
    caller and the gate) and exports them; `report` is the JSON view.

    `answered` is called by the gate for every admitted request: it is one attribute test after the
    first."""

    def __init__(self, histogram: Histogram, source_info: Gauge, clock: Callable[[], float] = time.monotonic,
                 age: Callable[[], float | None] = process_age_s, engine_info: Gauge | None = None) -> None:
        self._histogram = histogram
        self._source_info = source_info
        self._engine_info = engine_info
        self._clock = clock
        now, known = clock(), age()
        self._origin = now - (known or 0.0)  # the process's start on `clock`
        self.process_started = time.time() - (known or 0.0)
        self.models: dict[str, ModelStart] = {}
        self.weights_verify: float | None = None
        self.ready: float | None = None
        self.first_request: float | None = None
        self.waiting = True  # for the first answer
        self._lock = threading.Lock()
        for phase in PHASES:  # every phase exported from the start: a first observation is a change
            histogram.labels(phase)

    def since_start(self) -> float:
        return max(0.0, self._clock() - self._origin)

    def _model(self, name: str) -> ModelStart:
        return self.models.setdefault(name, ModelStart())

    def weights(self, name: str, found: WeightsSource) -> None:
        self._model(name).weights = found
        self._source_info.labels(name, found.source).set(1)
        if found.seconds is not None:
            self._histogram.labels("weights").observe(found.seconds)
        log.info("weights of %s: %s%s", name, found.source,
                 "" if found.seconds is None else f" in {found.seconds:.2f}s")

    def weights_verified(self, seconds: float) -> None:
        self.weights_verify = seconds
        self._histogram.labels("weights_verify").observe(seconds)

    def engine_build(self, name: str, found: BuildSource) -> None:
        """Where the build `name`'s engine loads came from (engines that build something only)."""
        self._model(name).engine = found
        if self._engine_info is not None:
            self._engine_info.labels(name, found.source).set(1)
        log.info("%s: engine build %s at %s", name, found.describe(), found.path)

    def engine_loaded(self, name: str, seconds: float) -> None:
        self._model(name).engine_load = seconds
        self._histogram.labels("engine_load").observe(seconds)

    def warmed_up(self, name: str, seconds: float) -> None:
        self._model(name).warmup = seconds
        self._histogram.labels("warmup").observe(seconds)

    def all_ready(self) -> None:
        """Every model serves (once; a later call changes nothing)."""
        with self._lock:
            if self.ready is not None:
                return
            self.ready = self.since_start()
        self._histogram.labels("ready").observe(self.ready)
        log.info("ready %.2fs after process start", self.ready)

    def answered(self) -> None:
        """The first request answered with a 2xx (the gate calls this while `waiting`)."""
        with self._lock:
            if not self.waiting:
                return
            self.waiting = False
            self.first_request = self.since_start()
        self._histogram.labels("first_request").observe(self.first_request)

    def phases(self) -> dict[str, float]:
        """Each phase's seconds, summed over the models (the flat view the operator's Event names);
        phases not reached or not known are left out."""
        out: dict[str, float] = {}
        for start in self.models.values():
            parts = (("weights", start.weights.seconds if start.weights else None),
                     ("engine_load", start.engine_load), ("warmup", start.warmup))
            for phase, seconds in parts:
                if seconds is not None:
                    out[phase] = out.get(phase, 0.0) + seconds
        for phase, seconds in (("weights_verify", self.weights_verify), ("ready", self.ready),
                               ("first_request", self.first_request)):
            if seconds is not None:
                out[phase] = seconds
        return {phase: round(out[phase], 3) for phase in PHASES if phase in out}

    def report(self) -> dict[str, Any]:
        """The ``startup`` section of GET /load."""
        sources = sorted({m.weights.source for m in self.models.values() if m.weights is not None})
        return {
            "process_started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.process_started))
            + f".{int(self.process_started % 1 * 1000):03d}Z",
            "phases": self.phases(),
            "weights_source": sources[0] if len(sources) == 1 else ",".join(sources) or None,
            "models": {name: _model_report(m) for name, m in self.models.items()},
        }


def _model_report(m: ModelStart) -> dict[str, Any]:
    out: dict[str, Any] = {"weights": m.weights.as_dict() if m.weights else None,
                           "engine_load": _r(m.engine_load), "warmup": _r(m.warmup)}
    if m.engine is not None:
        out["engine"] = m.engine.as_dict()
    return out

