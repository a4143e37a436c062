"""What the hub keeps between reconciles and what one placement pass sees: the records its collaborators share.

``HubState`` (the tables kept across reconciles), ``SpokeLink`` (one spoke's connection and the bookkeeping
of the hub's writes there) and ``SpokeView`` (one FleetCluster as judged, and as a placement pass sees it)
are read and written by the links (links.py), the cluster observation (clusters.py), the spoke writes
(writes.py), the hub objects' status (reporting.py), the placement (placing.py) and the controller
(controller.py). They live here, apart from all of those, so that each of them imports these records and
none has to import another: the records hold data and do no I/O.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from embedfleet.operator.background import track_pool
from embedfleet.operator.hub.breaker import Breaker
from embedfleet.operator.hub.health import Health
from embedfleet.operator.hub.informer import Informer
from embedfleet.operator.kube import Kube
from embedfleet.operator.platform import PlatformPolicy
from embedfleet.operator.scheduling import Cluster, Placement


@dataclass
class SpokeLink:
    """The hub's connection to one spoke: its client, its two informers and its own writer thread."""

    name: str
    kube: Kube
    fingerprint: str
    copies: Informer
    lease: Informer
    checked: float  # monotonic time the kubeconfig Secret was last read
    writer: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: track_pool(
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spoke-writer")))
    #: The batch running on ``writer``: hub object -> its ``writes.Outcome`` (writes.py imports this module).
    batch: concurrent.futures.Future[dict[str, Any]] | None = None
    written: str = ""  # the newest resourceVersion the spoke returned for the hub's writes
    breaker: Breaker = field(default_factory=Breaker)
    namespaces: set[str] = field(default_factory=set)  # known to exist there
    #: namespace/name -> (fingerprint last written, monotonic time the hub's Secret was last compared)
    secrets: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: Copies whose last write has an unknown outcome (timed out, connection lost, 5xx): the spoke may have
    #: done it. The next attempt reads the object first, so a hung spoke that comes back is not sent the
    #: same create twice.
    unsure: set[str] = field(default_factory=set)
    #: Writes the spoke refused (4xx: its RBAC, a same-named object it owns): key -> (when, the problem,
    #: the manifest refused). Tried again after REFUSAL_RETRY_S or as soon as the wanted copy changes, so a
    #: refusal costs one request per retry period, not one per pass, and its problem stays in status.
    refused: dict[str, tuple[float, str, str]] = field(default_factory=dict)

    def busy(self) -> bool:
        return self.batch is not None and not self.batch.done()

    def close(self) -> None:
        self.copies.stop(timeout=0.1)
        self.lease.stop(timeout=0.1)
        self.writer.shutdown(wait=False, cancel_futures=True)


@dataclass
class SpokeView:
    """One FleetCluster as its cluster reconcile judged it, and as a placement pass sees it."""

    name: str
    region: str
    cluster: Cluster
    health: Health
    link: SpokeLink | None
    error: str | None  # why the spoke could not be read
    last_seen: str | None
    copies: dict[str, dict[str, Any]] | None = None  # hub-managed copies by namespace/name; None: unknown
    #: The spoke's platform allow-lists (the key is ``cluster.platform_policy``); a sentence when unreadable.
    policy: PlatformPolicy | str = field(default_factory=PlatformPolicy)
    gateway_url: str | None = None  # FleetCluster spec.gatewayUrl: where other clusters' gateways spill to
    #: Skipped this pass (writes running, breaker open, or its watch not yet showing the hub's writes):
    #: its status rows are carried over. The sentence says why when it is a problem (breaker open).
    held: str | None = None
    skipped: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)  # the FleetCluster's (rollout waves select on them)


@dataclass
class HubState:
    health: dict[str, Health] = field(default_factory=dict)
    links: dict[str, SpokeLink] = field(default_factory=dict)
    seen: dict[str, tuple[float, str]] = field(default_factory=dict)  # (monotonic, wall) of the last renewal seen
    #: The platform policy annotation each spoke last published: kept while its lease cannot be read, so a
    #: spoke in its grace period is not judged by other rules (and its shares do not flap).
    policies: dict[str, str | None] = field(default_factory=dict)
    #: Spokes whose credentials failed: cluster -> (reason, sentence).
    credentials: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Rollout soak clocks: hub object -> (revision, wave, wall time the wave was first seen healthy).
    soak: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    #: Each FleetCluster as its last cluster reconcile judged it (health, policy, link); a placement pass
    #: places on these, with the copies as the spoke's watch shows them at that moment.
    views: dict[str, SpokeView] = field(default_factory=dict)
    #: The last placement pass's placements (the PlacementPolicies' status is written from them).
    placements: dict[str, Placement] = field(default_factory=dict)
