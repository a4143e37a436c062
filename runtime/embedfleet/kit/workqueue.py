"""A rate-limited work queue of keys, with client-go's workqueue semantics, and the workers that drain it.

What a controller needs between its informers and its reconcile function:

- **Keys, deduplicated.** ``add(key)`` of a key already waiting is a no-op: ten events about one object
  between two reconciles cost one reconcile. A key added while a worker holds it is queued again when the
  worker is ``done`` with it, never handed to two workers at once.
- **Back-off per key.** ``add_rate_limited(key)`` re-queues a failed key after ``base * 2**(failures-1)``
  seconds, capped at ``max_delay`` (:func:`backoff`), until ``forget(key)`` resets it after a success; a
  key that keeps failing is retried ever more slowly without slowing the others.
- **Delays.** ``add_after(key, seconds)``: a resync, or "look again when this rollout's soak ends". A key
  waits in the delay heap once, at its earliest due time: adding it again later is a no-op, sooner moves it.
- **Metrics** through :class:`QueueMetrics` hooks: depth, adds, time waiting in the queue, time a worker
  spent, retries; :func:`prometheus_metrics` binds them to a component's Prometheus counters.

Written here rather than taken from a library: the ``kubernetes`` package has no work queue, and kopf's
is internal to its handlers. It is ~200 lines of one lock and one condition variable, property-tested
(tests/kit/test_workqueue.py).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def backoff(failures: int, base: float, max_delay: float) -> float:
    """Seconds before the next try of a key that failed ``failures`` times in a row (>= 1)."""
    if failures <= 0:
        return 0.0
    return min(max_delay, base * 2.0 ** min(failures - 1, 64))


class QueueMetrics:
    """Hooks a queue calls; the default does nothing."""

    def declared(self, name: str) -> None:
        """A queue of this name exists (its series are exported from the start, at zero)."""

    def added(self, name: str) -> None: ...

    def depth(self, name: str, depth: int) -> None: ...

    def waited(self, name: str, seconds: float) -> None: ...

    def worked(self, name: str, seconds: float) -> None: ...

    def retried(self, name: str) -> None: ...


@dataclass
class _PrometheusQueueMetrics(QueueMetrics):
    adds: Any
    depth_gauge: Any
    latency: Any
    work: Any
    retries: Any

    def declared(self, name: str) -> None:
        for metric in (self.adds, self.depth_gauge, self.latency, self.work, self.retries):
            metric.labels(name=name)

    def added(self, name: str) -> None:
        self.adds.labels(name=name).inc()

    def depth(self, name: str, depth: int) -> None:
        self.depth_gauge.labels(name=name).set(depth)

    def waited(self, name: str, seconds: float) -> None:
        self.latency.labels(name=name).observe(seconds)

    def worked(self, name: str, seconds: float) -> None:
        self.work.labels(name=name).observe(seconds)

    def retried(self, name: str) -> None:
        self.retries.labels(name=name).inc()


def prometheus_metrics(prefix: str, registry: Any = None) -> QueueMetrics:
    """``{prefix}_workqueue_{depth,adds_total,queue_seconds,work_seconds,retries_total}{name}``."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    reg = registry if registry is not None else REGISTRY
    buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
    return _PrometheusQueueMetrics(
        adds=Counter(f"{prefix}_workqueue_adds", "Keys added to a work queue", ["name"], registry=reg),
        depth_gauge=Gauge(f"{prefix}_workqueue_depth", "Keys waiting in a work queue", ["name"], registry=reg),
        latency=Histogram(f"{prefix}_workqueue_queue_seconds", "Time a key waited before a worker took it",
                          ["name"], buckets=buckets, registry=reg),
        work=Histogram(f"{prefix}_workqueue_work_seconds", "Time a worker spent on a key", ["name"],
                       buckets=buckets, registry=reg),
        retries=Counter(f"{prefix}_workqueue_retries", "Keys re-queued after a failure", ["name"], registry=reg),
    )


class WorkQueue:
    def __init__(self, name: str, *, base_delay: float = 0.05, max_delay: float = 60.0,
                 metrics: QueueMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.metrics = metrics or QueueMetrics()
        self.metrics.declared(name)
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[str] = deque()
        self._dirty: set[str] = set()  # waiting (in _queue), or to be queued again when done
        self._processing: set[str] = set()
        self._added_at: dict[str, float] = {}
        self._delayed: list[tuple[float, int, str]] = []  # (due, order, key)
        self._due: dict[str, float] = {}  # each delayed key's earliest due time (older heap entries are stale)
        self._order = 0
        self._failures: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._shutdown = False

    # ------------------------------------------------------------ adding

    def add(self, key: str) -> None:
        with self._cond:
            self._add(key)

    def _add(self, key: str) -> None:
        if self._shutdown or key in self._dirty:
            return
        self._dirty.add(key)
        self.metrics.added(self.name)
        if key in self._processing:
            return  # queued again by done()
        self._queue.append(key)
        self._added_at[key] = self._clock()
        self.metrics.depth(self.name, len(self._queue))
        self._cond.notify()

    def add_after(self, key: str, seconds: float) -> None:
        if seconds <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shutdown:
                return
            due = self._clock() + seconds
            if self._due.get(key, float("inf")) <= due:
                return  # already due as soon or sooner: one delayed entry per key, however often it is added
            self._due[key] = due
            self._order += 1
            heapq.heappush(self._delayed, (due, self._order, key))
            self._cond.notify()

    def add_rate_limited(self, key: str) -> None:
        with self._cond:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
        self.metrics.retried(self.name)
        self.add_after(key, backoff(failures, self.base_delay, self.max_delay))

    def forget(self, key: str) -> None:
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: str) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    # ------------------------------------------------------------ taking

    def _promote_due(self) -> float | None:
        """Move due delayed keys into the queue; seconds until the next one is due (None: none)."""
        now = self._clock()
        while self._delayed and self._delayed[0][0] <= now:
            due, _, key = heapq.heappop(self._delayed)
            if self._due.get(key) == due:
                del self._due[key]
                self._add(key)
        return self._delayed[0][0] - now if self._delayed else None

    def get(self, timeout: float | None = None) -> str | None:
        """The next key (the caller must call ``done`` with it), or None after ``timeout`` or shutdown."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                next_due = self._promote_due()
                if self._queue:
                    key = self._queue.popleft()
                    self._dirty.discard(key)
                    self._processing.add(key)
                    now = self._clock()
                    self.metrics.waited(self.name, now - self._added_at.pop(key, now))
                    self.metrics.depth(self.name, len(self._queue))
                    self._started[key] = now
                    return key
                if self._shutdown:
                    return None
                wait = next_due
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait)

    def done(self, key: str) -> None:
        with self._cond:
            self._processing.discard(key)
            started = self._started.pop(key, None)
            if started is not None:
                self.metrics.worked(self.name, self._clock() - started)
            if key in self._dirty:  # added while it was being worked on
                self._queue.append(key)
                self._added_at[key] = self._clock()
                self.metrics.depth(self.name, len(self._queue))
                self._cond.notify()

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)


@dataclass(frozen=True)
class Result:
    """What a reconcile asks for beyond success: look at the key again after ``requeue_after`` seconds."""

    requeue_after: float | None = None


class Workers:
    """``count`` threads draining ``queue`` into ``reconcile(key)``: a success forgets the key's failures
    (and re-queues it after ``requeue_after`` when asked), an exception re-queues it with back-off."""

    def __init__(self, queue: WorkQueue, reconcile: Callable[[str], Result | None], count: int = 1) -> None:
        self.queue = queue
        self.reconcile = reconcile
        self._threads = [threading.Thread(target=self._run, name=f"{queue.name}-{i}", daemon=True)
                         for i in range(count)]

    def start(self) -> Workers:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.queue.shutdown()
        for thread in self._threads:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            key = self.queue.get()
            if key is None:
                return
            try:
                result = self.reconcile(key)
            except Exception:
                log.exception("%s: reconcile of %s failed; retried in %.2g s", self.queue.name, key,
                              backoff(self.queue.failures(key) + 1, self.queue.base_delay, self.queue.max_delay))
                self.queue.add_rate_limited(key)
            else:
                self.queue.forget(key)
                if result is not None and result.requeue_after is not None:
                    self.queue.add_after(key, result.requeue_after)
            finally:
                self.queue.done(key)
