"""Each runtime pod's cold start, reported once when it first turns Ready: an Event on its
EmbeddingDeployment and ``embedfleet_cold_start_seconds{phase}`` (docs/observability.md, "Cold starts").

Rides on the pod watch the autoscaler already keeps (its ``runtime_pods`` index: kopf opens one watch per
resource for every handler of it), so it needs no new RBAC verb: pods ``list``/``watch`` and events
``create`` are the chart's already. Which phases, from which timestamps, and whether a sight of a pod is
news are decided in operator/cold_start.py; this handler reads the runtime's own phases from the pod's
``GET /load`` (no API key, the address the autoscaler scrapes) with a short deadline, and names only the
pod-visible phases when the pod does not answer. The histogram takes only the pod-visible phases: the
runtime exports its own under the same name, so nothing is counted twice.

Once per pod per operator process, and only for a Ready seen while this process watched: after a restart
or a leader change, pods that were Ready already are not reported again. Each boundary this process saw
happen (the pod created, scheduled, initialized, its containers started, Ready) is timed by when its watch
event arrived (operator/cold_start.py `sight`), to about a tenth of a second (kopf's batching of an object's
events), where the Pod's own timestamps are whole seconds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx
import kopf

from embedfleet.operator import cold_start, metrics
from embedfleet.operator.crd import naming
from embedfleet.operator.signals import pod_targets

#: The runtime's GET /load answer is a few hundred bytes; more is not our runtime.
MAX_LOAD_BYTES = 64 * 1024
#: One attempt, bounded: the Event should not wait on a pod that does not answer.
READ_DEADLINE_S = 2.0
log = logging.getLogger(__name__)
RUNTIME_PODS = {naming.COMPONENT_LABEL: "runtime", naming.MANAGED_BY_LABEL: naming.MANAGED_BY}


class _Reported:
    """Pods (by uid) whose Ready this process has reported or found already Ready; forgotten on delete."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uids: set[str] = set()
        self.since = datetime.now(UTC)

    def restart(self) -> None:
        with self._lock:
            self._uids.clear()
            self.since = datetime.now(UTC)

    def claim(self, uid: str, ready_at: datetime | None) -> bool:
        """True once for a pod whose first Ready is news (cold_start.should_report)."""
        with self._lock:
            news = cold_start.should_report(ready_at, uid in self._uids, self.since)
            if ready_at is not None:
                self._uids.add(uid)  # reported now, or Ready before the watch: never news later
            return news

    def forget(self, uid: str) -> None:
        with self._lock:
            self._uids.discard(uid)


REPORTED = _Reported()


class _Sightings:
    """Per pod (by uid), when this process saw each of its boundaries happen (cold_start.Seen); kept until the
    pod is reported or deleted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, cold_start.Seen] = {}

    def update(self, uid: str, times: cold_start.PodTimes) -> cold_start.Seen:
        with self._lock:
            seen = cold_start.sight(self._seen.get(uid), times, datetime.now(UTC))
            self._seen[uid] = seen
            return seen

    def forget(self, uid: str) -> None:
        with self._lock:
            self._seen.pop(uid, None)


SIGHTINGS = _Sightings()


@kopf.on.startup()
def _watching(**_: Any) -> None:
    """Pods become news from when kopf starts watching (a standby's wait for the Lease does not count)."""
    REPORTED.restart()


def read_startup(pod: Mapping[str, Any], default_port: int) -> dict[str, Any] | None:
    """The runtime's ``startup`` section of GET /load, or None (no IP, refused, slow, too big, not JSON)."""
    targets = pod_targets([pod], default_port)
    if not targets:
        return None
    url = targets[0].url.removesuffix("/metrics") + "/load"
    try:
        with httpx.stream("GET", url, timeout=READ_DEADLINE_S) as answer:
            if answer.status_code != 200:
                return None
            body = b""
            for chunk in answer.iter_bytes():
                body += chunk
                if len(body) > MAX_LOAD_BYTES:
                    return None
        doc = httpx.Response(200, content=body).json()
    except (httpx.HTTPError, ValueError):
        return None
    startup = doc.get("startup") if isinstance(doc, dict) else None
    return startup if isinstance(startup, dict) else None


@kopf.on.event("", "v1", "pods", labels=RUNTIME_PODS, id="cold-start")
def runtime_pod_changed(event: Mapping[str, Any], body: kopf.Body, namespace: str, labels: kopf.Labels,
                        embedding_index: kopf.Index, **_: Any) -> None:
    """A runtime pod changed: on its first Ready, one Event and one observation per phase. Logged with
    this module's logger, not kopf's: kopf's per-object logger would post each line as an Event on the pod."""
    uid = body.get("metadata", {}).get("uid") or ""
    if event.get("type") == "DELETED":
        REPORTED.forget(uid)
        SIGHTINGS.forget(uid)
        return
    pod = dict(body)
    times = cold_start.pod_times(pod)
    seen = SIGHTINGS.update(uid, times)
    if times.ready is not None:
        SIGHTINGS.forget(uid)  # reported now, or Ready before this process watched: nothing more to time
    if not REPORTED.claim(uid, times.ready):
        return
    phases = cold_start.pod_phases(cold_start.refined(times, seen))
    if phases is None:
        return
    owner = next(iter(embedding_index.get((namespace, labels.get(naming.INSTANCE_LABEL, "")), [])), None)
    port = int(((owner or {}).get("spec") or {}).get("runtime", {}).get("port") or 8080)
    startup = read_startup(pod, port)
    runtime = cold_start.runtime_phases(startup) if startup is not None else None
    message = cold_start.event_message(pod["metadata"]["name"], phases, runtime, cold_start.weights_source(startup),
                                       cold_start.engine_source(startup))
    metrics.observe_cold_start(phases)
    log.info("cold start: %s", message)
    if owner is not None and not (owner.get("metadata") or {}).get("deletionTimestamp"):
        kopf.info(owner, reason=cold_start.REASON, message=message[:1000])  # not on an object being deleted
