"""Reading revisions' probe outputs from their pods: the drift gate's only network I/O.

The gate needs one pod of each revision it compares. Pods are found in a list of the deployment's pods
(label ``embedfleet.dev/revision``), reached on their IP and the runtime port, as the autoscaler reaches
their /metrics, and asked ``GET /v1/models/{served}/probe``: the start-up probe outputs and fingerprint
(docs/rollouts.md). The timeout is short: a pod that does not answer is retried on the next converge,
and the gate's own timeout (spec.rollout.gateTimeoutSeconds) bounds how long that may go on.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from embedfleet.operator.crd import naming
from embedfleet.operator.rollout.revisions import ProbeRead

#: Seconds one probe read may take (connect and answer); the runtime serves it from memory, or answers 503
#: `probe_pending` within 3 s while its start-up probe still runs (read again on the next converge).
TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 1.0
#: Pods of one revision tried before its read counts as failed for this converge.
PODS_TRIED = 2
#: A probe answer is a few hundred floats a text; anything far larger is not one.
MAX_BODY = 16 * 1024 * 1024


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def ready_by_revision(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Ready runtime pods per revision label, whichever Deployment runs them."""
    out: dict[str, int] = {}
    for pod in pods:
        revision = ((pod.get("metadata") or {}).get("labels") or {}).get(naming.REVISION_LABEL)
        if revision and _ready(pod):
            out[revision] = out.get(revision, 0) + 1
    return out


def revision_ips(pods: Iterable[Mapping[str, Any]], revision: str) -> list[str]:
    """IPs of the ready pods of one revision, by name so the choice is stable between converges."""
    chosen = [p for p in pods if _ready(p)
              and ((p.get("metadata") or {}).get("labels") or {}).get(naming.REVISION_LABEL) == revision]
    chosen.sort(key=lambda p: p["metadata"].get("name", ""))
    return [p["status"]["podIP"] for p in chosen]


def read_probe(ips: list[str], port: int, model: str, timeout: float = TIMEOUT_S) -> ProbeRead:
    """The first answer among up to PODS_TRIED pods, or every failure in one line."""
    if not ips:
        return ProbeRead(error="no ready pod")
    errors = []
    path = f"/v1/models/{urllib.parse.quote(model, safe='')}/probe"
    # Connecting is quick or it is not happening (a pod whose runtime is still starting refuses at once).
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)),
                      follow_redirects=False) as client:
        for ip in ips[:PODS_TRIED]:
            host = f"[{ip}]" if ":" in ip else ip
            try:
                response = client.get(f"http://{host}:{port}{path}")
            except httpx.HTTPError as exc:
                errors.append(f"{ip}: {type(exc).__name__}: {exc}"[:300])
                continue
            if response.status_code != 200:
                errors.append(f"{ip}: HTTP {response.status_code} {response.text[:200]}")
                continue
            if len(response.content) > MAX_BODY:
                errors.append(f"{ip}: probe answer of {len(response.content)} bytes is too large")
                continue
            try:
                body = response.json()
            except ValueError as exc:
                errors.append(f"{ip}: not JSON: {exc}"[:300])
                continue
            if not isinstance(body, dict) or "outputs" not in body or "task" not in body:
                errors.append(f"{ip}: the answer has no task/outputs")
                continue
            return ProbeRead(body=body)
    return ProbeRead(error="; ".join(errors))
