"""This cluster's gateway load, as the spoke's heartbeat publishes it for the hub (issue 15).

Other regions' gateways spill requests here; the hub shows, on each FleetCluster, how loaded this
cluster's gateways are, so a spill target can be judged by more than "not marked down". The spoke asks
its chart's gateway pods (label ``embedfleet.dev/component=gateway``, the pods the autoscaler asks) for
``GET /gateway/load`` on every heartbeat, with the autoscaler's own client (gateway_signal.py), and folds
the answers into five numbers: a Lease annotation must stay small, so no per-deployment list.

The format has one home, this module: the spoke writes it (`annotation`), the hub reads it
(`parse_annotation`). A reading the spoke could not make (listing the pods refused) is no annotation
plus a heartbeat problem, never zeros: ``"gateways": 0`` means this cluster runs no gateway pod.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from embedfleet.operator.gateway_signal import POD_LABELS, ask_gateways, gateway_targets
from embedfleet.operator.kube import Kube

#: Each gateway has this long to answer, all asked at once: the heartbeat's cost is bounded by it.
DEADLINE_S = 1.0
#: The summary's keys, in the order they are written (camelCase: they are copied to FleetCluster status).
FIELDS = ("gateways", "unanswered", "held", "inFlight", "coldDeployments")
_MAX = 1 << 31  # a cap no real count reaches: a garbled report cannot publish an absurd number


def _count(value: Any) -> int:
    """A gateway's number as a count: a finite number >= 0 rounded, anything else 0 (a gateway of another
    version may leave a field out)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0
    return max(0, min(_MAX, round(value)))


def summarize(reports: Iterable[Mapping[str, Any] | str]) -> dict[str, int]:
    """Fold the gateways' `/gateway/load` reports (parsed JSON, or why one gave none). Pure.

    ``held`` and ``inFlight`` are summed over every gateway and deployment (in flight includes held).
    A deployment is cold when the gateways hold requests for it and none of those that know it sees a
    ready replica: several gateways front the same deployments, so it is counted once, not per gateway.
    """
    answered = unanswered = held = in_flight = 0
    held_by: dict[str, int] = {}
    ready_by: dict[str, int] = {}
    for report in reports:
        if isinstance(report, str):
            unanswered += 1
            continue
        answered += 1
        deployments = report.get("deployments")
        if not isinstance(deployments, Mapping):
            continue
        for key, entry in deployments.items():
            if not isinstance(entry, Mapping):
                continue
            n = _count(entry.get("held"))
            held += n
            in_flight += _count(entry.get("in_flight"))
            held_by[key] = held_by.get(key, 0) + n
            ready_by[key] = max(ready_by.get(key, 0), _count(entry.get("ready_replicas")))
    cold = sum(1 for key, n in held_by.items() if n > 0 and ready_by[key] == 0)
    return {"gateways": answered, "unanswered": unanswered, "held": held, "inFlight": in_flight,
            "coldDeployments": cold}


def annotation(summary: Mapping[str, int]) -> str:
    """The Lease annotation's value: compact JSON, keys in `FIELDS` order (the same summary, the same text)."""
    return json.dumps({k: summary[k] for k in FIELDS}, separators=(",", ":"))


def from_mapping(raw: Any) -> dict[str, int] | None:
    """A summary from a mapping (the annotation parsed, or a FleetCluster's status.gateway); None when it
    is not one. Missing or malformed numbers count 0."""
    if not isinstance(raw, Mapping) or not any(k in raw for k in FIELDS):
        return None
    return {k: _count(raw.get(k)) for k in FIELDS}


def parse_annotation(raw: str | None) -> dict[str, int] | None:
    """What the hub makes of the annotation; None when absent (a spoke older than this, or one that could
    not list its gateway pods) or unreadable."""
    if not raw:
        return None
    try:
        return from_mapping(json.loads(raw))
    except ValueError:
        return None


def cluster_status(url: str | None, summary: Mapping[str, int] | None) -> dict[str, Any]:
    """FleetCluster ``status.gateway``: the spec's address and the reported summary. Every key is present,
    None where unknown, so a merge patch removes what is no longer known, and an empty one compares equal
    to the ``{}`` the API server defaults it to (no write per round for a cluster with nothing to say)."""
    return {"url": url, **{k: None if summary is None else summary.get(k) for k in FIELDS}}


def read(kube: Kube, namespace: str, port: int, deadline_s: float = DEADLINE_S) -> dict[str, int]:
    """This cluster's summary; raises KubeError when the gateway pods cannot be listed (the caller says so).

    The pods are the chart's, in the spoke operator's own namespace; each is asked at ``port`` (the
    chart's gateway.port), all at once. One that does not answer within ``deadline_s`` is ``unanswered``.
    """
    pods = kube.list("Pod", namespace, POD_LABELS)
    return summarize(asyncio.run(ask_gateways(gateway_targets(pods, port), deadline_s)))
