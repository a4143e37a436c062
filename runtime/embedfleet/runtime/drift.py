"""Drift monitoring: re-run the probe every --probe-interval seconds and compare it with the reference.

A silent change under a running revision (a driver, a kernel, a quantisation fallback, a CPU without the
instruction the engine assumed) changes the vectors without changing any spec field. The monitor shows
it: `embedfleet_probe_cosine` and `embedfleet_probe_order_kept` carry the last comparison's figures,
`embedfleet_probe_checks_total{outcome}` counts ok / drift / error, and a drift is logged as a warning
naming the figure. The operator reads the gauges from the pods' /metrics and sets `Degraded`.

A check that fails to run (the engine refused or failed the probe) counts `outcome="error"` and is
logged; it never stops the server or the monitor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from embedfleet.compat.gate import GateResult, ProbeOutputs, compare
from embedfleet.runtime.metrics import RuntimeMetrics

log = logging.getLogger(__name__)
OUTCOMES = ("ok", "drift", "error")


class DriftMonitor:
    """One model's periodic check. `probe()` re-runs the probe (through the batch manager). `reference` may
    be None when made (the start-up probe, the default reference, runs once the model serves): it is set
    before `start`."""

    def __init__(self, model: str, reference: ProbeOutputs | None, probe: Callable[[], Awaitable[ProbeOutputs]],
                 interval: float, min_cosine: float, metrics: RuntimeMetrics) -> None:
        self.model = model
        self.reference = reference
        self.probe = probe
        self.interval = interval
        self.min_cosine = min_cosine
        self.metrics = metrics
        self.last: GateResult | None = None
        self._task: asyncio.Task | None = None
        for outcome in OUTCOMES:  # exported from the start, so a rate() over them has a zero to rise from
            metrics.probe_checks.labels(model, outcome)

    def record(self, outputs: ProbeOutputs) -> GateResult:
        """Compare `outputs` with the reference, export the figures, warn on drift."""
        assert self.reference is not None, "the reference is set before the monitor starts"
        result = compare(self.reference, outputs, self.min_cosine)
        self.last = result
        # no cosine at all (outputs of another shape) is the worst drift there is: 0
        self.metrics.probe_cosine.labels(self.model).set(result.min_cosine or 0.0)
        self.metrics.probe_order_kept.labels(self.model).set(1 if result.order_kept else 0)
        self.metrics.probe_checks.labels(self.model, "ok" if result.passed else "drift").inc()
        if result.passed:
            log.debug("probe check of %s: %s", self.model, result.message)
        else:
            log.warning("probe drift on %s against its reference (--probe-min-cosine %g): %s", self.model,
                        self.min_cosine, result.message)
        return result

    async def check(self) -> GateResult | None:
        """One re-run and comparison; None when the check itself failed (counted as `error`)."""
        try:
            outputs = await self.probe()
            return self.record(outputs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.probe_checks.labels(self.model, "error").inc()
            log.warning("probe check of %s failed: %s: %s", self.model, type(exc).__name__, exc)
            return None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"drift-{self.model}")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
