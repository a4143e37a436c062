"""The peer decisions (operator/cache/peers.py) under hypothesis: which peers, in which order, then the origin;
what a peer's manifest proves; and the token bucket's rate."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.operator.cache.digest import render_manifest
from embedfleet.operator.cache.peers import (
    ZONE_LABEL,
    AgentPod,
    Step,
    TokenBucket,
    choose_peers,
    fetch_plan,
    manifest_proves,
    peer_url,
)

KEY = "cache.embedfleet.dev/t0123456789-sha256-0123456789abcdef"
PORT = 8476
node_names = st.sampled_from([f"node-{i}" for i in range(8)])
zones = st.sampled_from([None, "z1", "z2"])


@st.composite
def clusters(draw: st.DrawFn) -> tuple[dict[str, dict[str, str]], list[AgentPod]]:
    nodes: dict[str, dict[str, str]] = {}
    for name in draw(st.sets(node_names, max_size=8)):
        labels: dict[str, str] = {}
        if draw(st.booleans()):
            labels[KEY] = draw(st.sampled_from(["ready", "ready", "pulling", ""]))
        zone = draw(zones)
        if zone:
            labels[ZONE_LABEL] = zone
        nodes[name] = labels
    # Pod IPs are unique (or missing while a pod starts); several pods of one node happen during a rollout.
    agents = [AgentPod(node=draw(node_names), ip=draw(st.sampled_from(["", f"10.0.{i}.1", f"fd00::{i + 1}"])),
                       ready=draw(st.booleans())) for i in range(draw(st.integers(0, 10)))]
    return nodes, agents


@settings(max_examples=300)
@given(clusters(), node_names, st.integers(0, 5), st.text(max_size=8))
def test_peers_are_ready_holders_other_than_this_node_near_first(
        cluster: tuple[dict[str, dict[str, str]], list[AgentPod]], me: str, max_peers: int, salt: str) -> None:
    nodes, agents = cluster
    chosen = choose_peers(me, KEY, nodes, agents, PORT, salt=salt, max_peers=max_peers)
    eligible = {n for n, labels in nodes.items() if n != me and labels.get(KEY) == "ready"
                and any(a.node == n and a.ready and a.ip for a in agents)}
    assert len(chosen) == min(max_peers, len(eligible))
    assert len(set(chosen)) == len(chosen)  # one agent per node, each asked once
    urls_of = {n: {peer_url(a.ip, PORT) for a in agents if a.node == n and a.ready and a.ip} for n in eligible}
    mine = {peer_url(a.ip, PORT) for a in agents if a.node == me}
    for url in chosen:
        assert any(url in urls for urls in urls_of.values())  # only a Ready agent of a node holding it
        assert url.startswith("http://") and url.endswith(f":{PORT}")
    assert not set(chosen) & mine  # never this node's own agent
    # Near first: a node in this node's zone is never ranked behind one elsewhere.
    my_zone = nodes.get(me, {}).get(ZONE_LABEL)
    if my_zone:
        zone_of = {url: nodes[n].get(ZONE_LABEL) for n, urls in urls_of.items() for url in urls}
        near = [zone_of[u] == my_zone for u in chosen]
        assert near == sorted(near, reverse=True)
    # Deterministic: the same inputs, the same answer (every agent restart agrees with itself).
    assert chosen == choose_peers(me, KEY, nodes, list(reversed(agents)), PORT, salt=salt, max_peers=max_peers)


def test_many_fetchers_spread_over_the_holders() -> None:
    """Twenty nodes pulling one model do not all ask the same holder first."""
    nodes = {f"h{i}": {KEY: "ready"} for i in range(4)} | {f"n{i}": {} for i in range(20)}
    agents = [AgentPod(node=n, ip=f"10.0.{i}.1", ready=True) for i, n in enumerate(nodes)]
    firsts = [choose_peers(f"n{i}", KEY, nodes, agents, PORT, salt="sha256:ab")[0] for i in range(20)]
    assert len(set(firsts)) >= 3


def test_an_ipv6_peer_is_bracketed() -> None:
    assert peer_url("fd00::7", 8476) == "http://[fd00::7]:8476"


@given(st.lists(st.sampled_from(["http://a:1", "http://b:1", "http://c:1"]), max_size=6), st.text(min_size=1))
def test_the_plan_asks_each_peer_once_in_order_then_always_the_origin(peers: list[str], origin: str) -> None:
    plan = fetch_plan(peers, origin)
    assert plan[-1] == Step("origin", origin)
    assert [s.kind for s in plan].count("origin") == 1
    asked = [s.url for s in plan[:-1]]
    assert asked == list(dict.fromkeys(peers))
    assert all(s.kind == "peer" for s in plan[:-1])


files = st.lists(st.tuples(st.binary(max_size=32), st.sampled_from(["a", "b/c", "config.json", "w.safetensors"])),
                 min_size=1, max_size=4, unique_by=lambda t: t[1])


@given(files, st.integers(0, 3))
def test_a_manifest_proves_only_its_own_digest(entries: list[tuple[bytes, str]], flip: int) -> None:
    pairs = [(hashlib.sha256(data).hexdigest(), rel) for data, rel in entries]
    directory_digest = hashlib.sha256(render_manifest(pairs)).hexdigest()
    assert manifest_proves(pairs, directory_digest)
    assert manifest_proves(list(reversed(pairs)), directory_digest)  # order of the lines does not matter
    changed = list(pairs)
    i = flip % len(changed)
    changed[i] = (hashlib.sha256(changed[i][0].encode()).hexdigest(), changed[i][1])  # one file's bytes differ
    assert not manifest_proves(changed, directory_digest)
    assert not manifest_proves(pairs[:-1], directory_digest)  # a file left out
    assert not manifest_proves([], directory_digest)
    if len(pairs) == 1:
        assert manifest_proves(pairs, pairs[0][0])  # a single-file source: the file's sha256 is the digest
    archive = hashlib.sha256(b"an archive").hexdigest()
    assert not manifest_proves(pairs, archive)  # an unpacked archive's files prove nothing about it


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@settings(max_examples=300)
@given(st.floats(1e3, 1e9), st.lists(st.integers(1, 4 << 20), min_size=1, max_size=40),
       st.lists(st.floats(0, 0.5), max_size=40))
def test_the_bucket_holds_the_rate_whatever_the_chunks(rate: float, chunks: list[int], gaps: list[float]) -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate, clock=clock, sleep=clock.sleep)
    idle = 0.0
    for i, n in enumerate(chunks):
        gap = gaps[i] if i < len(gaps) else 0.0
        clock.now += gap
        idle += gap
        bucket.take(n)
    total = sum(chunks)
    # Never faster than the rate beyond one burst, and never slower than the rate plus the idle time.
    assert clock.now + 1e-6 >= (total - bucket.burst) / rate
    assert clock.now <= total / rate + idle + 1e-6


def test_a_bucket_refuses_a_rate_of_zero() -> None:
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(0)
