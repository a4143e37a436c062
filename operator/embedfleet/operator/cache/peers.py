"""Weights from peer nodes: the decisions, pure (no I/O; the clock and sleep are passed in).

A node agent that lacks an entry asks other nodes' agents for it before the origin. Three decisions:

* `choose_peers`: which agents to ask, in which order. Only nodes whose label says they hold *this
  tenant's* entry ready (the label the agents publish, `naming.cache_label_key`), never this node, only
  agents that are Ready and have a pod IP; nodes in this node's zone first (cheaper, faster links), then
  an order hashed from (this node, digest) so that many nodes pulling the same model at once spread over
  the holders instead of all asking the first one; at most ``max_peers``.
* `fetch_plan`: the peers in that order, then the origin, always last and always present: a peer is an
  optimisation, never a dependency.
* `manifest_proves`: whether a peer's file list alone proves the digest (a directory or single-file
  source). An archive's digest covers the archive, which is gone after unpacking, so a peer cannot prove
  what it serves for one: such entries come from the origin.

`TokenBucket` bounds the bytes per second a node takes from its peers, so a pull never saturates the
link of a node whose replicas are serving traffic.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .digest import render_manifest

ZONE_LABEL = "topology.kubernetes.io/zone"
READY = "ready"
#: How many peers one pull asks at most before it goes to the origin.
DEFAULT_MAX_PEERS = 3


@dataclass(frozen=True)
class AgentPod:
    """A node agent as its pod says: on which node, at which IP, and whether it is Ready."""

    node: str
    ip: str
    ready: bool


@dataclass(frozen=True)
class Step:
    """One place to fetch from: ``kind`` is ``peer`` or ``origin``; ``url`` the peer's base URL or the source."""

    kind: str
    url: str


def peer_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def _spread(salt: str, node: str) -> str:
    return hashlib.sha256(f"{salt}\0{node}".encode()).hexdigest()


def choose_peers(
    self_node: str,
    label_key: str,
    nodes: Mapping[str, Mapping[str, str]],
    agents: Iterable[AgentPod],
    port: int,
    salt: str = "",
    max_peers: int = DEFAULT_MAX_PEERS,
) -> list[str]:
    """Base URLs of the agents to ask, best first (see the module docstring).

    ``nodes``: node name -> its labels (at least every node labelled ``label_key``; others are ignored);
    ``agents``: the node-agent pods; ``salt``: what varies the spread (the digest).
    """
    self_zone = (nodes.get(self_node) or {}).get(ZONE_LABEL)
    by_node: dict[str, str] = {}
    for agent in sorted(agents, key=lambda a: (a.node, a.ip)):
        if agent.ready and agent.ip and agent.node not in by_node:
            by_node[agent.node] = agent.ip
    holders = [name for name, labels in nodes.items()
               if name != self_node and labels.get(label_key) == READY and name in by_node]

    def rank(name: str) -> tuple[bool, str, str]:
        near = self_zone is not None and nodes[name].get(ZONE_LABEL) == self_zone
        return (not near, _spread(f"{self_node}\0{salt}", name), name)

    return [peer_url(by_node[name], port) for name in sorted(holders, key=rank)[:max(0, max_peers)]]


def fetch_plan(peers: Sequence[str], origin: str) -> list[Step]:
    """The peers in order (each once), then the origin."""
    seen: set[str] = set()
    steps: list[Step] = []
    for url in peers:
        if url not in seen:
            seen.add(url)
            steps.append(Step("peer", url))
    return [*steps, Step("origin", origin)]


def manifest_proves(entries: Sequence[tuple[str, str]], expected_hex: str) -> bool:
    """True when (sha256 hex, path) pairs are exactly what ``expected_hex`` names: the directory digest
    (sha256 of the canonical manifest) or a single file whose sha256 is the digest."""
    if not entries:
        return False
    if hashlib.sha256(render_manifest(entries)).hexdigest() == expected_hex:
        return True
    return len(entries) == 1 and entries[0][0] == expected_hex


class TokenBucket:
    """At most ``rate`` bytes per second on average, with bursts of up to ``burst`` bytes.

    ``take(n)`` may drive the balance negative (a chunk is taken whole) and then sleeps until the debt is
    repaid, so the time spent over N bytes is at least (N - burst) / rate, whatever the chunk sizes.
    Thread-safe: one bucket bounds every download of one agent together.
    """

    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(16 * 1024.0, self.rate / 10)
        self._clock, self._sleep = clock, sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Account for ``n`` bytes; sleep as long as the rate needs; return the seconds slept."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait
