"""Events about an EmbeddingDeployment, written by its autoscaler daemon (scale decisions, an unavailable
signal, unreachable pods, probe drift): one place for their shape, so `kubectl describe` reads them alike.

``KUBE`` is the daemon's client too (handlers/autoscale_daemon.py, handlers/probe_drift.py share it).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import kubernetes

from embedfleet.operator.crd import naming
from embedfleet.operator.kube import Kube

KUBE = Kube()
KIND = naming.EMBEDDING_DEPLOYMENT_KIND


def now_iso() -> str:
    """Wall-clock now as the API server writes times (RFC 3339, whole seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def record_event(body: dict[str, Any], reason: str, message: str, type_: str = "Normal") -> None:
    """A core/v1 Event about the EmbeddingDeployment, named ``<object>.<nanoseconds hex>`` like kubectl's.

    The name is explicit (unique per decision) rather than ``generateName``: one request, no retry on
    a generated-name collision.
    """
    meta = body["metadata"]
    stamp = now_iso()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": naming.API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": type_,
        "source": {"component": "embedfleet-autoscaler"},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    kubernetes.client.CoreV1Api(KUBE.client).create_namespaced_event(
        meta["namespace"], event, _request_timeout=(5, 30)
    )
