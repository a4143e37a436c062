"""The spoke's heartbeat: a coordination.k8s.io Lease in its own cluster, renewed every interval.

The hub reads it through the spoke's kubeconfig (pull model, see docs/hub.md). Its annotations also carry
what the scheduler scores on: the weights cached on this spoke's nodes (node labels written by
``embedfleet cache pull --label-node``), and, when the spoke could not find that out (its identity may
not list nodes), why: ``embedfleet.dev/heartbeat-problem``, which the hub shows on the FleetCluster.
A heartbeat that reports "nothing cached" must mean nothing is cached, never "I was not allowed to look".

It also publishes this spoke's platform allow-lists (``embedfleet.dev/platform-policy``, the compact JSON
of `platform.load()`): this spoke's operator refuses any deployment outside them, so the hub reads them to
place a deployment only where it would be accepted, and to say why not (docs/hub.md, "Spoke rules").

And this cluster's gateway load (``embedfleet.dev/gateway-load``, gateway_load.py): its gateway pods asked
every beat, each for at most a second, so the hub can show each region's load on its FleetCluster. A
gateway that does not answer is counted ``unanswered``; a refused pod list is a heartbeat problem, like a
refused node list. Neither ever stops the beat.

And what this spoke's runtimes measurably deliver (``embedfleet.dev/throughput``, throughput.py): embeddings per
busy second per (model, resource), from the engine counters the autoscaler scrapes. Written only when some
figure moved by more than `throughput.CHANGE` from what the Lease carries (compared with the live Lease, not
with this process's last write), and never removed by a beat.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from datetime import UTC, datetime
from typing import Any

from embedfleet.operator import platform
from embedfleet.operator.crd import naming
from embedfleet.operator.gateway_signal import gateway_port
from embedfleet.operator.kube import Kube, KubeError
from embedfleet.operator.scheduling import learn
from embedfleet.operator.spoke import gateway_load, throughput

log = logging.getLogger(__name__)


LEASE_NAME = "embedfleet-spoke"
CACHED_ANNOTATION = "embedfleet.dev/cached-models"
#: Set while the heartbeat cannot report everything it should (e.g. listing nodes is refused); removed once it can.
PROBLEM_ANNOTATION = "embedfleet.dev/heartbeat-problem"
REGION_ANNOTATION = "embedfleet.dev/region"
#: This spoke's PlatformPolicy as compact camelCase JSON; absent on spokes older than the hub's reading of it.
POLICY_ANNOTATION = "embedfleet.dev/platform-policy"
#: This cluster's gateway load (gateway_load.py); absent while the gateway pods cannot be listed.
GATEWAY_LOAD_ANNOTATION = "embedfleet.dev/gateway-load"
#: Measured embeddings per second per busy replica, per (model, resource): the hub's cost ranking learns from
#: it (scheduling/learn.py: its format; `learn.annotation` writes it). Absent: the hub ranks by its prior. A beat
#: writes it only when given one and never removes it, so a measurement written beside the heartbeat stays.
THROUGHPUT_ANNOTATION = "embedfleet.dev/throughput"
ENV_NAMESPACE = "EMBEDFLEET_NAMESPACE"
ENV_INTERVAL = "EMBEDFLEET_HEARTBEAT_INTERVAL"
ENV_DURATION = "EMBEDFLEET_LEASE_DURATION"


def policy_json(policy: platform.PlatformPolicy) -> str:
    """The annotation value: compact, by alias, every field written (defaults too), so the hub reads the
    same rules this spoke enforces even when the hub's defaults differ from the spoke's."""
    return policy.model_dump_json(by_alias=True)


def lease_body(
    namespace: str, holder: str, duration: int, cached: list[str], region: str | None, problem: str | None = None,
    policy: str | None = None, gateway: str | None = None, throughput: str | None = None,
) -> dict[str, Any]:
    """The Lease as the spoke writes it; a ``None`` annotation value removes that annotation (merge patch)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    annotations: dict[str, str | None] = {
        CACHED_ANNOTATION: ",".join(sorted(cached)),
        PROBLEM_ANNOTATION: problem,
        REGION_ANNOTATION: region or None,
        POLICY_ANNOTATION: policy,
        GATEWAY_LOAD_ANNOTATION: gateway,
    }
    if throughput is not None:  # never removed by a beat: whoever measures may write it beside the heartbeat
        annotations[THROUGHPUT_ANNOTATION] = throughput
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": LEASE_NAME, "namespace": namespace, "annotations": annotations},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "renewTime": now},
    }


def _refusal(exc: KubeError) -> str:
    """`HTTP 403 Forbidden: <the server's message>`: short, and the same every beat."""
    try:
        message = json.loads(exc.body).get("message") or exc.body
    except (ValueError, AttributeError):
        message = exc.body
    return f"HTTP {exc.status} {exc.reason}: {str(message)[:300]}"


def cached_models(kube: Kube) -> tuple[list[str], str | None]:
    """(cache keys some node reports ready; why they are unknown, or None).

    A key is the node label key without its prefix, ``t<10 hex of namespace>-sha256-<16 hex>``
    (`naming.cache_label_key`): per tenant, so the hub matches it against each deployment's namespace.
    """
    try:
        nodes = kube.list("Node")
    except KubeError as exc:
        return [], f"cannot list nodes, so cached models are unknown: {_refusal(exc)}"
    found: set[str] = set()
    for node in nodes:
        for key, value in ((node.get("metadata") or {}).get("labels") or {}).items():
            if key.startswith(naming.CACHE_LABEL_PREFIX) and value == naming.CACHE_LABEL_READY:
                found.add(key[len(naming.CACHE_LABEL_PREFIX):])
    return sorted(found), None


def gateway_summary(kube: Kube, namespace: str, port: int) -> tuple[str | None, str | None]:
    """(the gateway-load annotation, why it is missing, or None). A gateway that does not answer is in the
    summary as ``unanswered``; only a refused pod list leaves it out."""
    try:
        return gateway_load.annotation(gateway_load.read(kube, namespace, port)), None
    except KubeError as exc:
        return None, f"cannot list gateway pods, so gateway load is unknown: {_refusal(exc)}"


def throughput_update(lease: dict[str, Any] | None, measured: list[tuple[str, str, float]]) -> str | None:
    """The throughput annotation to write, or None to leave the Lease's as it is (`throughput.noticeable`)."""
    written = (((lease or {}).get("metadata") or {}).get("annotations") or {}).get(THROUGHPUT_ANNOTATION)
    return learn.annotation(measured) if throughput.noticeable(written, measured) else None


def renew(kube: Kube, namespace: str, holder: str, duration: int, policy: str | None = None,
          port: int | None = None, measured: list[tuple[str, str, float]] | None = None) -> str | None:
    """Create or renew the Lease; returns the problem it reported (None: a complete heartbeat).
    ``port``: the gateways' (default: the chart's, EMBEDFLEET_GATEWAY_PORT). ``measured``: this spoke's
    throughput figures (`throughput.Registry.entries`)."""
    cached, problem = cached_models(kube)
    gateway, gateway_problem = gateway_summary(kube, namespace, gateway_port() if port is None else port)
    problem = "; ".join(p for p in (problem, gateway_problem) if p) or None
    lease = kube.get("Lease", LEASE_NAME, namespace)
    body = lease_body(namespace, holder, duration, cached, os.environ.get("EMBEDFLEET_REGION"), problem, policy,
                      gateway, throughput_update(lease, measured or []))
    if lease is None:
        meta = body["metadata"]
        meta["annotations"] = {k: v for k, v in meta["annotations"].items() if v is not None}
        kube.create(body)
    else:
        kube.patch_merge("Lease", LEASE_NAME, namespace, {"metadata": body["metadata"], "spec": body["spec"]})
    return problem


class Heartbeat:
    def __init__(self, kube: Kube | None = None, policy: platform.PlatformPolicy | None = None,
                 measured: throughput.Registry | None = None) -> None:
        self.kube = kube or Kube()
        #: Filled by the autoscale daemons of this process (spoke/handlers.py hands it to them).
        self.measured = measured if measured is not None else throughput.Registry()
        # The rules this spoke's operator enforces (the same env it reads), published for the hub.
        self.policy = policy_json(policy if policy is not None else platform.load())
        # The chart's namespace (POD_NAMESPACE), where its Role lets the operator write Leases.
        self.namespace = (os.environ.get(ENV_NAMESPACE) or os.environ.get("POD_NAMESPACE")
                          or "embedfleet-system")
        self.interval = float(os.environ.get(ENV_INTERVAL, "10"))
        self.duration = int(float(os.environ.get(ENV_DURATION, "30")))
        self.holder = f"{socket.gethostname()}-{os.getpid()}"
        self.gateway_port = gateway_port()
        self.problem: str | None = None
        self.stop = threading.Event()

    def beat(self) -> None:
        """One renewal; a problem is logged when it appears or changes, not every beat."""
        problem = renew(self.kube, self.namespace, self.holder, self.duration, self.policy, self.gateway_port,
                        self.measured.entries())
        if problem != self.problem:
            if problem:
                log.warning("heartbeat incomplete (the hub sees this on the FleetCluster): %s", problem)
            else:
                log.info("heartbeat complete again: cached models and gateway load are reported")
            self.problem = problem

    def run_forever(self) -> None:
        while not self.stop.is_set():
            try:
                self.beat()
            except Exception as exc:  # a missed beat is tolerated by the hub's grace period; keep trying
                log.warning("heartbeat renewal failed: %s", exc)
            self.stop.wait(self.interval)
