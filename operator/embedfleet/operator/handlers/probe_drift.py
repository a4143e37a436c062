"""Probe drift as the autoscaler daemon sees it: the runtimes' periodic probe figures (read on the tick's
own scrape, or on their own when no tick scrapes) judged against ``spec.rollout.minCosine`` and written
to ``status.probeDrift`` when the verdict changes (rollout/drift.py decides; this module reads and writes).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import kubernetes

from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.handlers.embedding import refresh_status
from embedfleet.operator.handlers.events import KIND, KUBE, now_iso, record_event
from embedfleet.operator.render import runtime_name
from embedfleet.operator.rollout import drift
from embedfleet.operator.signals import PodReading, pod_targets, query_probe, scrape

log = logging.getLogger(__name__)

#: Operator-wide default (``embedfleet operator run --prometheus-url``); spec.autoscaling.prometheusUrl wins.
ENV_PROMETHEUS_URL = "EMBEDFLEET_PROMETHEUS_URL"
#: Drift read on its own is read no more often than this (seconds).
MIN_EVERY_S = 5.0


class DriftMemory(Protocol):
    """What `watch_drift` keeps between calls (the daemon's LoopState): status.probeDrift as last written,
    since kopf's view of the object may lag the daemon's own write."""

    probe_drift: Mapping[str, Any] | None


def prometheus_url(autoscaling: Mapping[str, Any]) -> str | None:
    """The Prometheus the deployment's signals come from: its own, else the operator's; None: the pods."""
    return autoscaling.get("prometheusUrl") or os.environ.get(ENV_PROMETHEUS_URL) or None


def drift_every_s(spec: EmbeddingDeploymentSpec) -> float:
    """How often drift is read when it costs a request of its own: no more often than the runtimes
    re-check (spec.rollout.probeIntervalSeconds), and at least once a minute."""
    return max(MIN_EVERY_S, min(60.0, spec.rollout.probe_interval_seconds))


def probe_readings(name: str, namespace: str, autoscaling: Mapping[str, Any], port: int,
                   pods: list[dict[str, Any]]) -> tuple[PodReading, ...] | None:
    """Per-pod probe figures when the autoscaler made no scrape this tick: Prometheus when configured,
    else the Ready pods' /metrics."""
    url = prometheus_url(autoscaling)
    if url:
        return query_probe(url, namespace, name, runtime_name(name))
    return asyncio.run(scrape(pod_targets(pods, port))).pods


def watch_drift(name: str, namespace: str, body: dict[str, Any], spec: EmbeddingDeploymentSpec, state: DriftMemory,
                readings: Sequence[PodReading] | None) -> drift.DriftVerdict | None:
    """Judge the pods' probe figures against spec.rollout.minCosine; write ``status.probeDrift`` only when
    the verdict changed, then let the reconcile's code re-derive Degraded from it (kopf runs no update
    handler for a status change). Pods that did not answer give no evidence either way; when none
    answered, the last verdict stands."""
    answered = [r for r in readings or () if r.error is None]
    if spec.rollout.probe_interval_seconds <= 0 or not answered:
        return None
    verdict = drift.assess({r.pod: drift.ProbeSample(r.probe_cosine, r.probe_order_kept) for r in answered},
                           spec.rollout.min_cosine)
    current = state.probe_drift if state.probe_drift is not None else (body.get("status") or {}).get("probeDrift")
    if not drift.changed(current, verdict):
        return None
    written = verdict.status(now_iso())
    KUBE.patch_status(KIND, name, namespace, {"probeDrift": written})
    state.probe_drift = written
    flipped = bool((current or {}).get("drifted")) != verdict.drifted
    if flipped:
        log.warning("%s/%s: %s", namespace, name, verdict.message)
        try:
            record_event(body, "ProbeDrift" if verdict.drifted else "ProbeInTolerance", verdict.message,
                         type_="Warning" if verdict.drifted else "Normal")
        except (kubernetes.client.ApiException, OSError) as exc:
            log.warning("could not record the probe drift event: %s", exc)
    if flipped or verdict.drifted:  # Degraded's status or its message follows the new verdict
        refresh_status(name, namespace)
    return verdict
