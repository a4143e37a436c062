"""Probe drift monitoring: from what each runtime pod says about its last probe re-check to
``status.probeDrift`` and the ``Degraded`` condition it implies. Pure: no I/O, no clock.

Each runtime re-embeds the canonical probe set every ``spec.rollout.probeIntervalSeconds`` and exports the
outcome against its revision's reference (docs/rollouts.md, "Drift monitoring"):
``embedfleet_probe_cosine{model}`` (the lowest per-text cosine) and ``embedfleet_probe_order_kept{model}``
(1/0). The autoscaler daemon reads both from the same /metrics scrape it already makes (or from Prometheus)
and hands them here as one `ProbeSample` per pod.

A pod is out of tolerance when its cosine is below ``spec.rollout.minCosine`` or it lost the probe's
similarity order. The operator re-applies the spec's bar rather than trusting the runtime's own verdict
(``embedfleet_probe_checks_total{outcome}``), so the condition always reflects the spec as it is now.
A pod that has not re-checked yet (no gauge; the first re-check comes one interval after start-up) is
neither drifted nor in tolerance: it is only counted as unchecked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The Degraded condition's reason while any pod's probe is out of tolerance.
REASON = "ProbeDrift"
#: status.probeDrift.message is capped by the CRD (4096); the list of pods is cut before that.
MAX_MESSAGE = 4000
#: Pods named one by one in the message (the rest are counted).
MAX_NAMED = 5


@dataclass(frozen=True)
class ProbeSample:
    """One pod's last probe re-check: the lowest cosine against its reference and whether the probe's
    similarity order held. Either is None when the pod does not (yet) export it."""

    cosine: float | None = None
    order_kept: bool | None = None

    @property
    def checked(self) -> bool:
        return self.cosine is not None or self.order_kept is not None

    def within(self, min_cosine: float) -> bool:
        """In tolerance (or unchecked). NaN never reaches here (the scrape drops non-finite values)."""
        return (self.cosine is None or self.cosine >= min_cosine) and self.order_kept is not False

    def describe(self) -> str:
        parts = []
        if self.cosine is not None:
            parts.append(f"cosine {self.cosine:.6f}")
        if self.order_kept is False:
            parts.append("similarity order lost")
        return ", ".join(parts) or "no probe figures"


@dataclass(frozen=True)
class DriftVerdict:
    """What ``status.probeDrift`` says (less ``checkedAt``, which the caller stamps when it writes)."""

    drifted: bool
    min_cosine: float | None
    pods: list[str] = field(default_factory=list)
    message: str = ""

    def status(self, checked_at: str) -> dict[str, Any]:
        """The ``status.probeDrift`` object (camelCase, as crd.statuses.ProbeDriftStatus serialises it)."""
        return {"drifted": self.drifted, "minCosine": self.min_cosine, "pods": list(self.pods),
                "message": self.message, "checkedAt": checked_at}


def _worst_first(item: tuple[str, ProbeSample]) -> tuple[float, bool, str]:
    pod, sample = item
    return (sample.cosine if sample.cosine is not None else math.inf, sample.order_kept is not False, pod)


def assess(samples: Mapping[str, ProbeSample], min_cosine: float) -> DriftVerdict:
    """The verdict over every pod that answered: drifted when any pod is out of tolerance.

    ``pods`` lists the out-of-tolerance pods worst first (lowest cosine, then order lost); the message
    names the worst pod and its figure. ``min_cosine`` is the lowest cosine any pod reported (None when
    none reported one).
    """
    checked = {pod: s for pod, s in samples.items() if s.checked}
    cosines = [s.cosine for s in checked.values() if s.cosine is not None]
    # Rounded as the message prints it: a re-check that moves the sixth decimal is no news to write.
    lowest = round(min(cosines), 6) if cosines else None
    bad = sorted(((pod, s) for pod, s in checked.items() if not s.within(min_cosine)), key=_worst_first)
    unchecked = len(samples) - len(checked)
    pending = f"; {unchecked} not re-checked yet" if unchecked else ""
    if not bad:
        if not checked:
            message = f"no pod has re-checked its probe yet ({len(samples)} answered)"
        else:
            low = "" if lowest is None else f", lowest cosine {lowest:.6f}"
            message = (f"probe within tolerance on {len(checked)} pod(s) (minCosine {min_cosine:g}{low}, "
                       f"order kept){pending}")
        return DriftVerdict(drifted=False, min_cosine=lowest, pods=[], message=message)
    worst_pod, worst = bad[0]
    named = "; ".join(f"{pod}: {s.describe()}" for pod, s in bad[1:MAX_NAMED])
    more = f" (+{len(bad) - MAX_NAMED} more)" if len(bad) > MAX_NAMED else ""
    message = (f"probe drift on {len(bad)} of {len(checked)} pod(s): worst {worst_pod} {worst.describe()} "
               f"against minCosine {min_cosine:g}" + (f"; also {named}{more}" if named else "") + pending)
    return DriftVerdict(drifted=True, min_cosine=lowest, pods=[pod for pod, _ in bad],
                        message=message[:MAX_MESSAGE])


def changed(current: Mapping[str, Any] | None, verdict: DriftVerdict) -> bool:
    """Whether ``status.probeDrift`` must be rewritten: the verdict differs from what it says (the stamp
    ``checkedAt`` aside, so a steady verdict writes nothing). No status and nothing checked: no write."""
    if not current:
        return verdict.drifted or bool(verdict.pods) or verdict.min_cosine is not None
    wanted = verdict.status("")
    return any(current.get(key) != wanted[key] for key in ("drifted", "minCosine", "pods", "message"))


def degraded(probe_drift: Mapping[str, Any] | None, own: Mapping[str, Any]) -> dict[str, Any]:
    """The Degraded condition once ``status.probeDrift`` is folded into the deployment's own one (``own``,
    as operator/status.py computes it from the Deployment).

    The Deployment's own failure (ReplicaFailure, a stalled rollout, ...) keeps the reason: it is what
    blocks the fleet now and what the user must act on first, and the drift figures come from the pods
    that still run. The drift message is appended so neither is hidden. Otherwise a drifted probe makes
    Degraded=True reason ``ProbeDrift``, and a probe back in tolerance leaves ``own`` as it is (False).
    """
    if not probe_drift or not probe_drift.get("drifted"):
        return dict(own)
    message = str(probe_drift.get("message") or "probe drift")
    if own.get("status") == "True":
        return {**own, "message": f"{own.get('message') or own.get('reason')}; {REASON}: {message}"}
    return {**own, "status": "True", "reason": REASON, "message": message}
