"""Kubernetes mode (`embedfleet gateway --kubernetes`): the fleet's replicas from the cluster itself.

Two informers of the control-plane kit (embedfleet/kit/informer.py: list, then watch from the newest
version with bookmarks, a relist when the server says the version is gone, back-off while it cannot be
reached) feed the same `Fleet` the static `--upstream` flags feed:

* EmbeddingDeployments: the served model name a request asks for (`spec.model.servedModelName`, else
  the object's name, as the runtime is told) -> the deployment `<namespace>/<name>`, whose runtime
  Service has the deployment's name (operator/render/). Mid-rollout, each live revision that is not
  current answers `<served>@rN` through its own Service `<name>-rN`; every route carries the vector
  space its requests are pinned to, from the deployment's status (pinning.py), and the deployment's own
  shed and spill bounds (`spec.runtime.maxQueueSeconds`, `maxQueueSecondsBulk`,
  `spec.placement.spillAfterSeconds`: bounds.py), the same for its main and its revision Services.
* EndpointSlices of those Services: the addresses that may take work. An endpoint that is `terminating`
  is dropped at once: a pod being deleted leaves the slice before its runtime's own /ready turns false, so
  draining replicas stop getting new requests first. One that is not `ready` yet (starting) is kept and
  polled like the others, and gets work once its own `GET /load` says it is ready (upstreams.py): a cold
  start is routed within --held-poll-interval of the runtime being able to answer, not after the kubelet's
  next readiness probe and the EndpointSlice's update on top of it. A replica that is not ready for load
  says so on the same poll (busy: the last resort), as it tells the kubelet.

Waking from zero: when the gateway holds a request for a deployment with no ready replica, it sets the
EmbeddingDeployment's scale subresource to 1 if it is at 0 (the operator's autoscaler acts on that change
at once and goes on from one replica). That is the whole of its write access (the chart's ClusterRole).

The informers run on threads (the kubernetes client is synchronous); a change adds the one key "routes" to
a kit work queue, whose worker hands the routes to the event loop once per burst of events (the queue
merges the adds of a relist of a thousand objects into one or two publications). Nothing on the event loop
ever waits on the API server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from embedfleet import api_group as naming
from embedfleet.gateway.bounds import Bounds, from_object
from embedfleet.gateway.pinning import revision_services
from embedfleet.gateway.spill import ANNOTATION
from embedfleet.kit.client import KubeClient, collection_path
from embedfleet.kit.informer import Informer
from embedfleet.kit.workqueue import Result, Workers, WorkQueue

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; it is resumed from the last resourceVersion
RETRY_S = 2.0  # after an error talking to the API server
WAKE_EVERY_S = 5.0  # at most one wake per deployment this often while requests are held
ROUTES = "routes"  # the one key of the routes' work queue
SYNC_POLL_S = 0.2  # how often the first publication looks whether every informer has listed


def deployment_key(namespace: str, name: str) -> str:
    """How the gateway names a deployment to the operator (GET /gateway/load)."""
    return f"{namespace}/{name}"


def served_name(obj: Mapping[str, Any]) -> str:
    """The model name requests use for this EmbeddingDeployment (as render.runtime_env tells the runtime)."""
    model = (obj.get("spec") or {}).get("model") or {}
    return model.get("servedModelName") or obj["metadata"]["name"]


def spill_annotation(obj: Mapping[str, Any]) -> str:
    """Where the hub lets this deployment's requests spill (gateway/spill.py parses it); "" for nowhere."""
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION, "")


def replica_urls(slice_: Mapping[str, Any], port_name: str = "http") -> list[str]:
    """http://ADDRESS:PORT of every endpoint of an EndpointSlice that may take new work, now or once its
    own /load says it is ready: every one that is not terminating, ready or still starting."""
    ports = slice_.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if port is None:
        return []
    out = []
    for endpoint in slice_.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("terminating") is True:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            out.append(f"http://{host}:{port}")
    return sorted(set(out))


@dataclass
class ClusterView:
    """What the watches have seen: pure bookkeeping, turned into the fleet's replica sets by `routes`."""

    deployments: dict[str, str] = field(default_factory=dict)  # "<ns>/<name>" -> served model name
    spill: dict[str, str] = field(default_factory=dict)  # "<ns>/<name>" -> the hub's spill-to annotation
    slices: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # "<ns>/<slice>" -> ("<ns>/<svc>", urls)
    # "<ns>/<name>" -> (model name, Service name, vector space) per name it answers (pinning.revision_services)
    names: dict[str, list[tuple[str, str, str | None]]] = field(default_factory=dict)
    bounds: dict[str, Bounds] = field(default_factory=dict)  # "<ns>/<name>" -> its own shed/spill bounds

    def record(self, obj: Mapping[str, Any]) -> None:
        """An EmbeddingDeployment as the API server sent it (listed, added or modified)."""
        key = deployment_key(obj["metadata"]["namespace"], obj["metadata"]["name"])
        served = served_name(obj)
        self.deployments[key] = served
        self.names[key] = revision_services(obj, served)
        self.spill[key] = spill_annotation(obj)
        self.bounds[key] = from_object(obj)

    def forget(self, key: str) -> None:
        for table in (self.deployments, self.names, self.spill, self.bounds):
            table.pop(key, None)

    def _names(self, key: str) -> list[tuple[str, str, str | None]]:
        return self.names.get(key) or [(self.deployments[key], key.split("/", 1)[1], None)]

    def routes(self) -> dict[str, tuple[str, list[str]]]:
        """model name -> (Service key, replica URLs): the bare served name -> the main Service `<ns>/<name>`,
        `<served>@rN` -> `<ns>/<name>-rN` (a live revision that is not current). Two deployments serving
        one name: the first by key wins (a warning names the other), so routing never flips between them."""
        out: dict[str, tuple[str, list[str]]] = {}
        urls: dict[str, set[str]] = {}
        for service, found in self.slices.values():
            urls.setdefault(service, set()).update(found)
        for key in sorted(self.deployments):
            namespace = key.split("/", 1)[0]
            for model, service, _ in self._names(key):
                if model in out:
                    log.warning("%s and %s both serve the model %r; requests go to %s", out[model][0], key, model,
                                out[model][0])
                    continue
                service_key = deployment_key(namespace, service)
                out[model] = (service_key, sorted(urls.get(service_key, ())))
        return out

    def service_bounds(self) -> dict[str, Bounds]:
        """Service key (as in `routes`) -> its deployment's own bounds: a revision's Service has the
        deployment's (limits are the spec's, not the revision's: operator/render/revisions.py spec_for)."""
        out: dict[str, Bounds] = {}
        for key in sorted(self.deployments):
            namespace = key.split("/", 1)[0]
            for _, service, _ in self._names(key):
                out.setdefault(deployment_key(namespace, service), self.bounds.get(key, Bounds()))
        return out

    def spaces(self) -> dict[str, str | None]:
        """Service key (as in `routes`) -> the vector space requests routed there are pinned to (None: the
        operator has not written one; such requests carry no pin)."""
        out: dict[str, str | None] = {}
        for key in sorted(self.deployments):
            namespace = key.split("/", 1)[0]
            for _, service, space in self._names(key):
                out.setdefault(deployment_key(namespace, service), space)
        return out


class KubeSource:
    """Keeps `apply(routes)` called with the cluster's current routes; wakes deployments at zero."""

    def __init__(self, api_client: kubernetes.client.ApiClient, namespaces: Iterable[str],
                 apply: Callable[[dict[str, tuple[str, list[str]]], dict[str, str | None], dict[str, Bounds]],
                                 None],
                 loop: asyncio.AbstractEventLoop,
                 apply_spill: Callable[[dict[str, str]], None] | None = None,
                 on_restart: Callable[[str], None] | None = None) -> None:
        self.api = api_client
        self.namespaces = list(namespaces)
        self.apply = apply
        self.apply_spill = apply_spill  # deployment -> its `embedfleet.dev/spill-to` annotation (spill.py)
        self.loop = loop
        self.view = ClusterView()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._woken: dict[str, float] = {}
        self.synced = threading.Event()  # every informer has listed once
        self.on_restart = on_restart  # told an informer's kind when its watch is opened again (a metric)
        self.informers: list[Informer] = []
        #: One key: the routes are published by one worker after each burst of changes.
        self._routes = WorkQueue("gateway-routes")
        self._workers = Workers(self._routes, self._publish_routes)

    # -- watches -------------------------------------------------------------------------------
    def start(self) -> None:
        kube = KubeClient(self.api)
        for ns in self.namespaces or [None]:
            scope = ns or "all"
            eds = Informer(kube, collection_path(naming.API_VERSION, naming.EMBEDDING_DEPLOYMENT_PLURAL, ns),
                           name=f"eds-{scope}", kind=naming.EMBEDDING_DEPLOYMENT_KIND,
                           timeout_seconds=WATCH_TIMEOUT_S, backoff=(RETRY_S, 10 * RETRY_S),
                           on_restart=self.on_restart)
            slices = Informer(kube, collection_path("discovery.k8s.io/v1", "endpointslices", ns),
                              name=f"slices-{scope}", kind="EndpointSlice", timeout_seconds=WATCH_TIMEOUT_S,
                              backoff=(RETRY_S, 10 * RETRY_S), on_restart=self.on_restart)
            eds.on_change = lambda key, inf=eds: self._changed(inf, key, self._on_deployment)
            slices.on_change = lambda key, inf=slices: self._changed(inf, key, self._on_slice)
            self.informers += [eds.start(), slices.start()]
        self._workers.start()
        self._routes.add(ROUTES)

    def stop(self) -> None:
        self._stop.set()
        for informer in self.informers:
            informer.stop(timeout=0.5)
        self._workers.stop(timeout=0.5)

    def _changed(self, informer: Informer, key: str, handle: Callable[[str, dict, str | None], None]) -> None:
        """An informer's change of ``key`` applied to the view: the object as it is now, or its deletion."""
        obj = informer.get(key)
        with self._lock:
            if obj is None:
                namespace, _, name = key.partition("/")
                handle("DELETED", {"metadata": {"namespace": namespace, "name": name}}, None)
            else:
                handle("MODIFIED", obj, None)
        self._routes.add(ROUTES)

    def _publish_routes(self, _key: str) -> Result | None:
        """The routes' one key, reconciled: published after each burst of changes (the kit's queue merges
        the adds made meanwhile); the first time once every informer has listed."""
        if not self.synced.is_set():
            if not all(informer.wait_synced(0) for informer in self.informers):
                return Result(requeue_after=SYNC_POLL_S)
            self.synced.set()
        self._publish()
        return None

    @staticmethod
    def _in_scope(key: str, ns: str | None) -> bool:
        return ns is None or key.split("/", 1)[0] == ns

    def _on_deployment(self, kind: str, obj: dict, ns: str | None) -> None:
        """One watch event (or RESET: a fresh list of scope `ns`, None for all namespaces)."""
        if kind == "RESET":
            for key in [k for k in self.view.deployments if self._in_scope(k, ns)]:
                self.view.forget(key)
            for item in obj.get("items") or []:
                self.view.record(item)
        elif kind == "DELETED":
            self.view.forget(deployment_key(obj["metadata"]["namespace"], obj["metadata"]["name"]))
        else:
            self.view.record(obj)

    def _on_slice(self, kind: str, obj: dict, ns: str | None) -> None:
        def entry(s: dict) -> tuple[str, tuple[str, list[str]]] | None:
            service = (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL)
            if not service:
                return None
            namespace = s["metadata"]["namespace"]
            return deployment_key(namespace, s["metadata"]["name"]), (deployment_key(namespace, service),
                                                                      replica_urls(s))

        if kind == "RESET":
            kept = {k: v for k, v in self.view.slices.items() if not self._in_scope(k, ns)}
            self.view.slices = kept | dict(e for e in map(entry, obj.get("items") or []) if e is not None)
            return
        if kind == "DELETED":  # by key: the object may be only its name
            self.view.slices.pop(deployment_key(obj["metadata"]["namespace"], obj["metadata"]["name"]), None)
            return
        found = entry(obj)
        if found is None:
            self.view.slices.pop(deployment_key(obj["metadata"]["namespace"], obj["metadata"]["name"]), None)
        else:
            self.view.slices[found[0]] = found[1]

    def _publish(self) -> None:
        with self._lock:
            routes = self.view.routes()
            spaces = self.view.spaces()
            bounds = self.view.service_bounds()
            spill = dict(self.view.spill)
        self.loop.call_soon_threadsafe(self.apply, routes, spaces, bounds)
        if self.apply_spill is not None:
            self.loop.call_soon_threadsafe(self.apply_spill, spill)

    # -- waking ----------------------------------------------------------------------------------
    async def wake(self, key: str) -> None:
        """Scale `<ns>/<name>` from 0 to 1 (scale subresource), at most once per WAKE_EVERY_S."""
        now = time.monotonic()
        if key not in self.view.deployments:
            return  # a revision's own Service (`<name>-rN`): its Deployment keeps minReplicas, nothing to wake
        if now - self._woken.get(key, float("-inf")) < WAKE_EVERY_S:
            return
        self._woken[key] = now
        await asyncio.to_thread(self._wake, key)

    def _wake(self, key: str) -> None:
        namespace, name = key.split("/", 1)
        custom = kubernetes.client.CustomObjectsApi(self.api)
        args = (naming.GROUP, naming.VERSION, namespace, naming.EMBEDDING_DEPLOYMENT_PLURAL, name)
        try:
            # The object, not its scale: GET .../scale answers 500 while spec.replicas is unset (an
            # autoscaled deployment that was never scaled by hand), and the scale says nothing of the
            # autoscaler's own size.
            obj = custom.get_namespaced_custom_object(*args, _request_timeout=10)
            size = fleet_size(obj)
            if size > 0:
                return  # already on its way (or scaled by someone else): nothing to do
            if ((obj.get("spec") or {}).get("replicas")) == 1:
                # Setting it again changes nothing the operator could see; it starts a replica from the
                # held requests this gateway reports (GET /gateway/load) instead.
                log.info("%s is at zero and its spec.replicas is already 1: waiting for the autoscaler", key)
                return
            custom.patch_namespaced_custom_object_scale(*args, {"spec": {"replicas": 1}}, _request_timeout=10,
                                                        _content_type="application/merge-patch+json")
            log.info("woke %s: scale 0 -> 1 (requests held)", key)
        except ApiException as exc:
            log.warning("could not wake %s: %s %s %s", key, exc.status, exc.reason, (exc.body or "")[:300])
        except Exception as exc:
            log.warning("could not wake %s: %s: %s", key, type(exc).__name__, exc)


def fleet_size(obj: Mapping[str, Any]) -> int:
    """Replicas an EmbeddingDeployment has or is about to have: the larger of the autoscaler's desired
    and the current count (status), or spec.replicas before the operator wrote any status."""
    replicas = (obj.get("status") or {}).get("replicas") or {}
    known = [int(v) for v in (replicas.get("desired"), replicas.get("current")) if v is not None]
    if known:
        return max(known)
    return int((obj.get("spec") or {}).get("replicas") or 0)
