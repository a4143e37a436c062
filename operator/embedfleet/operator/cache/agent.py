"""``embedfleet cache agent``: the one process per node that owns the node's weight cache.

It runs in the chart's node-agent DaemonSet (the operator's namespace, its own ServiceAccount: nodes
get/patch, EmbeddingDeployments and ModelCaches list; nothing else), so no tenant identity ever holds a
node right and the cache root is the platform's, never a tenant's choice. Each pass:

1. reads its own Node (labels: which pools it is in, whether it is a control-plane node);
2. reads EmbeddingDeployments and ModelCaches in all namespaces from two informers of the control-plane
   kit (embedfleet/kit/informer.py: one list, then a watch). A change wakes a pass at once (a second
   later, so a burst of changes makes one pass), so a new ModelCache or deployment starts its download
   within about a second instead of at the next ``--interval``, which stays as the resync period (the
   retention clock, a pull that failed). Until the informers have listed (and with ``--once``) a pass
   lists with ``resourceVersion=0``, answered from the API server's watch cache;
3. decides with the pure functions in `wanted` what this node should hold, pulls each missing entry
   into ``<cache-root>/<namespace>_sha256-<hex>`` (one failing pull is logged and retried next pass;
   the others go on), deletes entries nobody has wanted for ``--retention-seconds``;
4. keeps the tenants' engines folders of deployments that build an engine (`engine_sync`: created for
   the runtimes, bounded, filled from peers of the same accelerator);
5. merge-patches the node's ``cache.embedfleet.dev/t<tenant>-sha256-<16 hex>=ready`` labels to match
   exactly the wanted entries that are ready on disk, and the ``cache.embedfleet.dev/e<tenant>-...``
   labels to match the engine builds held (no write when they already do).

When each entry became unwanted is kept in ``<cache-root>/.agent-state.json``, so a restarted agent (or
``--once`` runs) keeps the retention clock.

With ``--peer-port`` the agent also serves its complete entries to other nodes' agents (`peer_server`),
and a pull asks the agents of nodes labelled ready for the same tenant's entry before the origin: it
lists those Nodes (label selector) and the agent pods (``--peer-selector`` in ``--peer-namespace``: their
pod IPs), orders them with `peers.choose_peers` and fetches through one `peers.TokenBucket`
(``--peer-rate``). A failed lookup (RBAC, API trouble) only means the origin.

With ``--health-dir`` the agent reports to the kubelet's exec probes (`Heartbeat`; the peer port is no health signal):
``alive`` is touched whenever the loop makes progress, a download's growing files included, so its age
says how long the loop has been stuck; ``ready`` exists while the last pass could read the cluster.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedfleet.operator.crd import naming
from embedfleet.operator.platform import PlatformPolicy

from .digest import READY_MARKER
from .engine_sync import scan_engines, sync_engines
from .engines import cpu_accelerator
from .peer_auth import PeerKey
from .peers import AgentPod, TokenBucket, choose_peers
from .pull import PullFailed, pull
from .wanted import ENTRY_NAME, label_patch, plan, wanted_engines, wanted_entries

log = logging.getLogger(__name__)

STATE_FILE = ".agent-state.json"
TMP_PREFIX = ".tmp-"
#: Seconds between beats while the agent waits for its next pass, and between a pull watcher's looks.
HEARTBEAT_S = 5.0
#: Seconds a change waits before its pass, so that a burst of changes (a relist, a chart install) is one pass.
CHANGE_SETTLE_S = 1.0


class RootNotWritable(Exception):
    """The cache root cannot be written by this process; the message says how to fix it."""


def check_root(root: Path) -> None:
    """Fail early and clearly: a root the kubelet created (owned by root, 0755) makes every pull fail
    with EACCES, pass after pass, which reads like a network problem in the logs."""
    uid, gid = os.getuid(), os.getgid()
    fix = (f"run `embedfleet cache prepare --cache-root {root} --owner {uid}:{gid}` as root; the chart's "
           "init container does")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + "probe-", dir=root))
        probe.rmdir()
    except OSError as exc:
        try:
            st = root.stat()
            owner = f"owned by uid {st.st_uid} (mode {st.st_mode & 0o7777:o})"
        except OSError:
            owner = "missing and cannot be created"
        raise RootNotWritable(
            f"cache root {root} is {owner} and not writable by uid {uid} ({exc.strerror}): {fix}"
        ) from exc


@dataclass
class AgentConfig:
    node_name: str
    root: Path
    policy: PlatformPolicy
    retention_s: float = 3600.0
    max_pull_bytes: int | None = None
    pull_retries: int = 1
    pull_timeout_s: float = 60.0
    #: Port of this agent's peer server and of every other agent's; None: no peers (serve nor ask).
    peer_port: int | None = None
    peer_host: str = "0.0.0.0"
    #: Where the agent pods are, to find a peer node's agent: a label selector in a namespace.
    peer_namespace: str = ""
    peer_selector: str = ""
    #: Bytes per second this node takes from its peers, all downloads together; None: unlimited.
    peer_rate: float | None = None
    max_peers: int = 3
    #: The release's peer key (`peer_auth`): requests to and from other agents are signed with it.
    peer_key: PeerKey | None = None
    #: Bytes one tenant's engines folder may hold on this node (the oldest builds go first); None: no bound.
    max_engine_bytes: int | None = None


class Cluster:
    """The agent's only reads and writes, through the official client (get/patch its Node, list or watch the
    two custom resources cluster-wide)."""

    def __init__(self, api_client: Any = None) -> None:
        import kubernetes  # here: the client is slow to import and `cache pull` never needs it

        from embedfleet.kit.client import TIMEOUT
        from embedfleet.operator.kube import load_client

        self._client = api_client or load_client()
        #: (connect, read) seconds of every call: an API server that accepts and hangs fails the pass.
        self.timeout = TIMEOUT
        self.core = kubernetes.client.CoreV1Api(self._client)
        self.custom = kubernetes.client.CustomObjectsApi(self._client)
        #: Set by the informers on any change of what they watch: the loop's cue for a pass.
        self.changed = threading.Event()
        self._informers: dict[str, Any] = {}

    def watch(self) -> None:
        """Keep the two collections in informers from now on (``list_all`` reads them once listed)."""
        from embedfleet.kit.client import KubeClient, collection_path
        from embedfleet.kit.informer import Informer

        kube = KubeClient(self._client)
        for plural in (naming.EMBEDDING_DEPLOYMENT_PLURAL, naming.MODEL_CACHE_PLURAL):
            self._informers[plural] = Informer(
                kube, collection_path(naming.API_VERSION, plural), name=plural, kind=plural,
                on_change=lambda _key: self.changed.set()).start()

    def stop(self) -> None:
        for informer in self._informers.values():
            informer.stop(timeout=0.5)

    def node_labels(self, name: str) -> dict[str, str]:
        node = self.core.read_node(name, _request_timeout=self.timeout)
        return dict(node.metadata.labels or {})

    def list_all(self, plural: str) -> list[dict[str, Any]]:
        informer = self._informers.get(plural)
        if informer is not None and informer.synced:
            return list(informer.items().values())
        data = self.custom.list_cluster_custom_object(
            naming.GROUP, naming.VERSION, plural, resource_version="0", _request_timeout=self.timeout
        )
        return list(data.get("items") or [])

    def holders(self, label_key: str) -> dict[str, dict[str, str]]:
        """Nodes labelled ready for this entry: name -> labels (``nodes list`` with a label selector)."""
        nodes = self.core.list_node(label_selector=f"{label_key}=ready", resource_version="0",
                                    _request_timeout=self.timeout)
        return {n.metadata.name: dict(n.metadata.labels or {}) for n in nodes.items}

    def agent_pods(self, namespace: str, selector: str) -> list[AgentPod]:
        """The node agents' pods (``pods list`` in the agents' own namespace, nothing more)."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector, resource_version="0",
                                             _request_timeout=self.timeout)
        out: list[AgentPod] = []
        for pod in pods.items:
            conditions = (pod.status.conditions or []) if pod.status else []
            ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
            out.append(AgentPod(node=pod.spec.node_name or "", ip=(pod.status.pod_ip if pod.status else "") or "",
                                ready=ready))
        return out

    def patch_labels(self, name: str, labels: Mapping[str, str | None]) -> None:
        self.core.patch_node(
            name, {"metadata": {"labels": dict(labels)}}, _content_type="application/merge-patch+json",
            _request_timeout=self.timeout,
        )


class Heartbeat:
    """The agent's health as two files for the kubelet's exec probes, in ``directory`` (the pod's /tmp).

    ``alive``: its mtime is the last time the loop made progress: a step of a pass, a few seconds of the
    wait between passes, or, during a pull (one long call), growth of the pull's temporary files, which a
    watcher thread looks at every ``every_s`` seconds. A download that moves is alive however long it
    takes; a loop hung in a call (an API request that never returns, a stalled filesystem, a deadlock)
    stops touching it, and the probe restarts the container once the file is older than its bound.
    ``ready``: present while the last pass could read this Node and the custom resources, i.e. the agent
    can do its job; removed when a pass fails."""

    ALIVE = "alive"
    READY = "ready"

    def __init__(self, directory: Path, root: Path, every_s: float = HEARTBEAT_S) -> None:
        self.directory, self.root, self.every_s = directory, root, every_s
        directory.mkdir(parents=True, exist_ok=True)

    def beat(self) -> None:
        (self.directory / self.ALIVE).touch()

    def ready(self, ready: bool) -> None:
        path = self.directory / self.READY
        if ready:
            path.touch()
        else:
            path.unlink(missing_ok=True)

    def _pulled_bytes(self) -> int:
        total = 0
        for tmp in self.root.glob(TMP_PREFIX + "*"):
            for folder, _, files in os.walk(tmp):
                for name in files:
                    try:
                        total += os.lstat(os.path.join(folder, name)).st_size
                    except OSError:  # renamed or removed meanwhile
                        pass
        return total

    @contextlib.contextmanager
    def pulling(self) -> Iterator[None]:
        """While the body runs, beat whenever the root's temporary files grew since the last look."""
        done = threading.Event()

        def watch() -> None:
            seen = self._pulled_bytes()
            while not done.wait(self.every_s):
                now = self._pulled_bytes()
                if now != seen:
                    self.beat()
                seen = now

        watcher = threading.Thread(target=watch, name="agent-pull-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join(timeout=self.every_s + 5)


def scan(root: Path) -> dict[str, bool]:
    """Cache entries in the root -> whether each is ready (its marker exists)."""
    out: dict[str, bool] = {}
    for child in root.iterdir():
        if ENTRY_NAME.match(child.name) and (child.is_dir() or child.is_symlink()):
            out[child.name] = (child / READY_MARKER).is_file()
    return out


def _load_state(root: Path) -> dict[str, float]:
    try:
        raw = json.loads((root / STATE_FILE).read_text())
        return {str(k): float(v) for k, v in (raw.get("unwantedSince") or {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_state(root: Path, unwanted_since: Mapping[str, float]) -> None:
    tmp = root / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps({"unwantedSince": dict(sorted(unwanted_since.items()))}))
    tmp.replace(root / STATE_FILE)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path)


def find_peers(config: AgentConfig, cluster: Cluster, node_labels: Mapping[str, str], label_key: str,
               digest: str) -> list[str]:
    """Base URLs of the agents holding this entry, best first; [] when peers are off or the lookup fails."""
    if config.peer_port is None or not config.peer_selector or not config.peer_namespace:
        return []
    try:
        nodes = cluster.holders(label_key)
        agents = cluster.agent_pods(config.peer_namespace, config.peer_selector)
    except Exception as exc:  # a lookup is an optimisation: the origin remains
        log.warning("peer lookup for %s failed (fetching from the origin): %s", label_key, exc)
        return []
    nodes.setdefault(config.node_name, dict(node_labels))
    return choose_peers(config.node_name, label_key, nodes, agents, config.peer_port, salt=digest,
                        max_peers=config.max_peers)


def run_pass(config: AgentConfig, cluster: Cluster, now: float | None = None,
             heartbeat: Heartbeat | None = None, bucket: TokenBucket | None = None) -> list[str]:
    """One pass (see the module docstring); returns the problems met (empty: all done)."""
    now = time.time() if now is None else now
    root = config.root
    problems: list[str] = []
    node_labels = cluster.node_labels(config.node_name)
    deployments = cluster.list_all(naming.EMBEDDING_DEPLOYMENT_PLURAL)
    caches = cluster.list_all(naming.MODEL_CACHE_PLURAL)
    if heartbeat is not None:
        heartbeat.ready(True)
        heartbeat.beat()
    wanted = wanted_entries(node_labels, deployments, caches, config.policy)
    engines_wanted = wanted_engines(node_labels, deployments, config.policy)

    # Pulls run one at a time in this process, so a temp dir seen here is a crashed pass's leftover.
    for child in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(child, ignore_errors=True)
    state = _load_state(root)
    decided = plan(wanted, scan(root), state, now, config.retention_s)
    engines_decided = plan(engines_wanted, scan_engines(root), state, now, config.retention_s)
    for name in [*decided.delete, *engines_decided.delete]:
        try:
            _remove(root / name)
            (root / f".lock-{name}").unlink(missing_ok=True)
            log.info("deleted %s: unwanted for %.0fs or more", name, config.retention_s)
        except OSError as exc:
            problems.append(f"delete {name}: {exc}")
    _save_state(root, {**decided.unwanted_since, **engines_decided.unwanted_since})
    for want in decided.pull:
        try:
            peers = find_peers(config, cluster, node_labels, want.label, want.digest)
            with heartbeat.pulling() if heartbeat is not None else contextlib.nullcontext():
                result = pull(want.source, want.digest, root, retries=config.pull_retries,
                              timeout_s=config.pull_timeout_s, entry=want.entry,
                              max_bytes=config.max_pull_bytes, peers=peers, bucket=bucket,
                              peer_key=config.peer_key)
            log.info("ready: %s for %s (source=%s, %.2fs, %d peer(s) known; %s)", result.path, want.namespace,
                     result.source, result.seconds, len(peers), result.fetched)
        except (PullFailed, OSError) as exc:
            problems.append(f"pull {want.entry} from {want.source}: {exc}")
            log.error("pull %s from %s failed (retried next pass): %s", want.entry, want.source, exc)
        if heartbeat is not None:
            heartbeat.beat()

    engines = sync_engines(
        root, engines_wanted, node_labels, cpu_accelerator(),
        (lambda label, digest: find_peers(config, cluster, node_labels, label, digest))
        if config.peer_port is not None else None,
        timeout_s=config.pull_timeout_s, bucket=bucket, max_bytes=config.max_engine_bytes, peer_key=config.peer_key)
    problems += engines.problems

    ready = [name for name, is_ready in scan(root).items() if is_ready]
    patch = label_patch(wanted, ready, node_labels, engines.labels)
    if patch:
        cluster.patch_labels(config.node_name, patch)
        log.info("node %s labels: %s", config.node_name,
                 ", ".join(f"{k}={v if v is not None else '(removed)'}" for k, v in sorted(patch.items())))
    return problems


def run(config: AgentConfig, interval_s: float, once: bool, cluster: Cluster | None = None,
        health_dir: Path | None = None) -> int:
    """Pass after pass until SIGTERM; ``once``: one pass, exit 1 if anything in it failed. ``health_dir``
    (ignored with ``once``): where the `Heartbeat` files for the kubelet's probes go."""
    check_root(config.root)
    cluster = cluster or Cluster()
    heartbeat = Heartbeat(health_dir, config.root) if health_dir is not None and not once else None
    bucket = TokenBucket(config.peer_rate) if config.peer_rate else None
    server = None
    if config.peer_port is not None and not once:
        from .peer_server import PeerServer  # here: aiohttp is needed only when peers are on

        server = PeerServer(config.root, config.peer_host, config.peer_port, config.peer_key).start()
    stop = threading.Event()
    if not once:
        def stopping(*_: Any) -> None:
            stop.set()
            cluster.changed.set()  # ends a wait at once

        signal.signal(signal.SIGTERM, stopping)
        signal.signal(signal.SIGINT, stopping)
        cluster.watch()
    while True:
        if heartbeat is not None:
            heartbeat.beat()
        try:
            problems = run_pass(config, cluster, heartbeat=heartbeat, bucket=bucket)
        except Exception as exc:  # an API hiccup must not end the agent; the next pass retries
            if once:
                raise
            log.exception("pass failed: %s", exc)
            problems = [str(exc)]
            if heartbeat is not None:
                heartbeat.ready(False)
        if once:
            for problem in problems:
                log.error("%s", problem)
            return 1 if problems else 0
        if _wait(stop, interval_s, heartbeat, cluster.changed):
            cluster.stop()
            if server is not None:
                server.stop()
            return 0


def _wait(stop: threading.Event, seconds: float, heartbeat: Heartbeat | None,
          changed: threading.Event | None = None) -> bool:
    """Wait ``seconds`` or until ``changed`` is set (then CHANGE_SETTLE_S more, so a burst of changes makes
    one pass), beating every HEARTBEAT_S (a waiting agent is a live one); True once stopped."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        step = max(0.0, min(left, HEARTBEAT_S))
        if changed is not None and changed.wait(step):
            if stop.wait(CHANGE_SETTLE_S):
                return True
            changed.clear()
            return False
        if stop.wait(0 if changed is not None else step):
            return True
        if left <= HEARTBEAT_S:
            return False
        if heartbeat is not None:
            heartbeat.beat()
