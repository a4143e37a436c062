"""The hub's links to its spokes: a client made from each FleetCluster's kubeconfig Secret, and per spoke
two informers (the copies this hub manages there, and the spoke's heartbeat Lease).

Separate from the cluster reconcile because connecting has its own clock and its own failures: a kubeconfig Secret is
read again every CREDENTIALS_RECHECK_S (sooner while the spoke refuses it), a changed one replaces the link
and its informers but keeps the write bookkeeping (breaker, namespaces, Secrets, unsure writes), and a
credential that cannot be used is an answer for the cluster observation (clusters.py), not a failed reconcile.
The links themselves are kept in the shared ``HubState.links`` (state.py).
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Callable, Mapping

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.fleet import FleetClusterSpec
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.credentials import CredentialPolicy, spoke_client
from embedfleet.operator.hub.errors import SPOKE_ERRORS
from embedfleet.operator.hub.informer import Informer
from embedfleet.operator.hub.state import HubState, SpokeLink
from embedfleet.operator.kube import Kube
from embedfleet.operator.spoke.heartbeat import LEASE_NAME

ED_PATH = f"/apis/{naming.API_VERSION}/{naming.EMBEDDING_DEPLOYMENT_PLURAL}"  # all namespaces
#: Spoke requests retry a dropped connection once (an API server restart), no more: the breaker decides.
SPOKE_RETRIES = 1
#: How often the hub re-reads a spoke's kubeconfig Secret (a rotated credential is picked up; the
#: default, overridden by EMBEDFLEET_HUB_CREDENTIALS_RECHECK), and, while the spoke refuses the credential,
#: how soon it looks again.
CREDENTIALS_RECHECK_S = 60.0
CREDENTIALS_RETRY_S = 5.0
#: How long a cluster reconcile waits, in all, for the first lists of spokes it has just connected to.
LINK_WAIT_S = 2.0


class Links:
    """Makes, re-checks and replaces the links in ``state.links``; reads the kubeconfig Secrets on ``hub``."""

    def __init__(self, hub: Kube, state: HubState, credential_policy: CredentialPolicy, write_timeout: float,
                 credentials_recheck: float, on_change: Callable[[str, str], None] | None = None) -> None:
        self.hub = hub
        self.state = state
        self.credential_policy = credential_policy
        self.write_timeout = write_timeout
        self.credentials_recheck = credentials_recheck
        #: Told ``(cluster, "copies" | "lease")`` when a spoke's informer sees a change (the controller
        #: queues that cluster's reconcile, or placement).
        self.on_change = on_change

    def _hook(self, cluster: str, what: str) -> Callable[[str], None] | None:
        if self.on_change is None:
            return None
        on_change = self.on_change
        return lambda _key: on_change(cluster, what)

    def spoke_client(self, raw: bytes) -> Kube:
        kube, _ = spoke_client(raw, self.credential_policy, timeout=(5.0, self.write_timeout),
                               retries=SPOKE_RETRIES)
        return kube

    def link(self, name: str, spec: FleetClusterSpec, now: float) -> SpokeLink:
        """The spoke's link; its kubeconfig Secret is read again every CREDENTIALS_RECHECK_S (sooner while
        the spoke refuses it), and a changed one replaces the link and its informers."""
        link = self.state.links.get(name)
        due = min(CREDENTIALS_RETRY_S, self.credentials_recheck) if name in self.state.credentials \
            else self.credentials_recheck
        if link is not None and now - link.checked < due:
            return link
        ref = spec.connection.kubeconfig_secret
        secret = self.hub.get("Secret", ref.name, ref.namespace)
        if secret is None or ref.key not in (secret.get("data") or {}):
            raise ValueError(f"kubeconfig Secret {ref.namespace}/{ref.name} has no key {ref.key}")
        raw = base64.b64decode(secret["data"][ref.key])
        fingerprint = hashlib.sha256(raw).hexdigest()
        if link is not None and link.fingerprint == fingerprint:
            link.checked = now
            return link
        kube = self.spoke_client(raw)
        lease_ns = spec.connection.namespace
        copies = Informer(kube, ED_PATH, name=f"{name}-copies", kind=naming.EMBEDDING_DEPLOYMENT_KIND,
                          label_selector=f"{convert.HUB_MANAGED_LABEL}={name}", on_change=self._hook(name, "copies"))
        lease = Informer(kube, kube.kinds["Lease"].path(lease_ns), name=f"{name}-lease", kind="Lease",
                         field_selector=f"metadata.name={LEASE_NAME}", on_change=self._hook(name, "lease"))
        new = SpokeLink(name, kube, fingerprint, copies.start(), lease.start(), now)
        if link is not None:
            new.breaker, new.namespaces, new.secrets, new.unsure = (link.breaker, link.namespaces, link.secrets,
                                                                    link.unsure)
            link.close()
        self.state.links[name] = new
        return new

    def connect(self, specs: Mapping[str, FleetClusterSpec], now: float) -> dict[str, SpokeLink | BaseException]:
        """Every FleetCluster's link (or why there is none). New links list concurrently and get one short
        shared wait, so a hub starting on a hundred spokes does not wait for them one by one."""
        out: dict[str, SpokeLink | BaseException] = {}
        fresh: list[SpokeLink] = []
        for name, spec in specs.items():
            known = self.state.links.get(name)
            try:
                out[name] = link = self.link(name, spec, now)
            except SPOKE_ERRORS as exc:
                out[name] = exc
                continue
            if link is not known:
                fresh.append(link)
        deadline = time.monotonic() + LINK_WAIT_S
        for link in fresh:
            for informer in (link.lease, link.copies):
                informer.wait_synced(max(0.0, deadline - time.monotonic()))
        return out

    def close(self) -> None:
        for link in self.state.links.values():
            link.close()
