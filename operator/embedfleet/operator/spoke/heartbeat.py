"""The spoke's heartbeat: a coordination.k8s.io Lease in its own cluster, renewed every interval.

The hub reads it through the spoke's kubeconfig (pull model, see docs/hub.md). Its annotations also carry
what the scheduler scores on: the weights cached on this spoke's nodes (node labels written by
``embedfleet cache pull --label-node``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import UTC, datetime
from typing import Any

from embedfleet.operator.crd import naming
from embedfleet.operator.kube import Kube, KubeError

log = logging.getLogger(__name__)


LEASE_NAME = "embedfleet-spoke"
CACHED_ANNOTATION = "embedfleet.dev/cached-models"
ENV_NAMESPACE = "EMBEDFLEET_NAMESPACE"
ENV_INTERVAL = "EMBEDFLEET_HEARTBEAT_INTERVAL"
ENV_DURATION = "EMBEDFLEET_LEASE_DURATION"


def lease_body(namespace: str, holder: str, duration: int, cached: list[str], region: str | None) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    annotations = {CACHED_ANNOTATION: ",".join(sorted(cached))}
    if region:
        annotations["embedfleet.dev/region"] = region
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": LEASE_NAME, "namespace": namespace, "annotations": annotations},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "renewTime": now},
    }


def cached_models(kube: Kube) -> list[str]:
    """Digest keys some node reports ready (``sha256-<16 hex>``), from the cache node labels."""
    found: set[str] = set()
    try:
        nodes = kube.list("Node")
    except KubeError:
        return []
    for node in nodes:
        for key, value in ((node.get("metadata") or {}).get("labels") or {}).items():
            if key.startswith(naming.CACHE_LABEL_PREFIX) and value == naming.CACHE_LABEL_READY:
                found.add(key[len(naming.CACHE_LABEL_PREFIX):])
    return sorted(found)


def renew(kube: Kube, namespace: str, holder: str, duration: int) -> None:
    body = lease_body(namespace, holder, duration, cached_models(kube), os.environ.get("EMBEDFLEET_REGION"))
    if kube.get("Lease", LEASE_NAME, namespace) is None:
        kube.create(body)
    else:
        kube.patch_merge("Lease", LEASE_NAME, namespace, {"metadata": body["metadata"], "spec": body["spec"]})


class Heartbeat:
    def __init__(self, kube: Kube | None = None) -> None:
        self.kube = kube or Kube()
        # The chart's namespace (POD_NAMESPACE), where its Role lets the operator write Leases.
        self.namespace = (os.environ.get(ENV_NAMESPACE) or os.environ.get("POD_NAMESPACE")
                          or "embedfleet-system")
        self.interval = float(os.environ.get(ENV_INTERVAL, "10"))
        self.duration = int(float(os.environ.get(ENV_DURATION, "30")))
        self.holder = f"{socket.gethostname()}-{os.getpid()}"
        self.stop = threading.Event()

    def run_forever(self) -> None:
        while not self.stop.is_set():
            try:
                renew(self.kube, self.namespace, self.holder, self.duration)
            except Exception as exc:  # a missed beat is tolerated by the hub's grace period; keep trying
                log.warning("heartbeat renewal failed: %s", exc)
            self.stop.wait(self.interval)
