"""Pod IPs that reach real processes, and nothing else.

kwok gives pods addresses from a /24 of 198.18.0.0/15 (RFC 2544, reserved for benchmarks: no network
uses it), one /24 per test process (`POD_CIDR`). Two routes keep every packet on this machine:

- `guard_pod_range()`: an ``unreachable`` route for the whole 198.18.0.0/15 in the root namespace,
  installed before any cluster starts. Without it, an operator scraping a kwok pod's IP sends the
  packet down the default route, off the machine. With it, such a connection fails at once, locally.
- `PodNetwork`: a network namespace where every address is local, reached through a veth pair by a more
  specific route for this process's /24, so a runtime started with ``ip netns exec NS ... --host
  198.18.7.5`` answers the scrape of the pod with that IP. Deleted (veth and route too) at teardown.
- `pod_ip_on_host(ip)`: one pod IP made an address of the root namespace (a ``local`` route), for a
  process that must answer on a pod's IP *and* reach the API server, which listens on the host's
  loopback (inside the namespace, 127.0.0.1 is the namespace's own): a gateway served on its pod's IP.

Needs root (CAP_NET_ADMIN) and ``ip``; without them the control-plane tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import ip_address, ip_network

GUARD_RANGE = "198.18.0.0/15"
LOCAL_RANGE = "198.18.0.0/16"
HOST_ADDR = "198.19.255.254"
INNER_ADDR = "198.19.255.253"
NETNS_DIR = "/run/netns"
PREFIX = "ef-pods-"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _able() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def reap_leftovers() -> list[str]:
    """Delete the pod networks of test processes that no longer run (a run killed before its teardown):
    their namespace, veth and routes, and the ``local`` routes `pod_ip_on_host` left in their range. A
    leftover's route would make a later process's /24 collide with it ("File exists"). Returns the names."""
    if not _able() or not os.path.isdir(NETNS_DIR):
        return []
    reaped = []
    for name in sorted(os.listdir(NETNS_DIR)):
        tag = name[len(PREFIX):]
        if not name.startswith(PREFIX) or not tag.isdigit() or os.path.exists(f"/proc/{tag}"):
            continue
        host_if = f"efh{tag}"[:15]
        routes = _ip("-o", "route", "show", "dev", host_if, check=False).stdout.split()
        for cidr in (r for r in routes if r.startswith("198.18.") and r.endswith("/24")):
            _ip("route", "flush", "table", "local", "root", cidr, check=False)
        _ip("link", "del", host_if, check=False)  # its routes go with it
        _ip("netns", "del", name, check=False)
        reaped.append(name)
    return reaped


def _pick_pod_cidr() -> str:
    """A /24 of 198.18.1-250 no live route uses, starting from this process's id (so concurrent runs start
    apart), after reaping the networks of processes that are gone."""
    start = os.getpid() % 250
    if not _able():
        return f"198.18.{start + 1}.0/24"
    reap_leftovers()
    used = set(_ip("-o", "route", "show", check=False).stdout.split())
    for step in range(250):
        cidr = f"198.18.{(start + step) % 250 + 1}.0/24"
        if cidr not in used:
            return cidr
    raise RuntimeError("every 198.18.x.0/24 for test pods is routed: too many pod networks on this machine")


#: This process's pod range (kwok --cidr): distinct /24s let concurrent test runs each own theirs.
POD_CIDR = _pick_pod_cidr()


def guard_pod_range() -> None:
    """Make the reserved range unreachable outside the test's namespace (idempotent, machine-wide).

    Left in place at exit on purpose: another test process may rely on it, and no network uses the
    range."""
    done = _ip("route", "replace", "unreachable", GUARD_RANGE, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"cannot install the unreachable route for {GUARD_RANGE}: {done.stderr.strip()}")


def unavailable_reason() -> str | None:
    if shutil.which("ip") is None:
        return "the test control plane needs `ip` (iproute2) to keep pod IPs on this machine"
    if os.geteuid() != 0:
        return "the test control plane needs root (CAP_NET_ADMIN) to keep pod IPs on this machine"
    return None


@dataclass
class PodNetwork:
    """A network namespace where every 198.18.x.y address is local; this process's POD_CIDR leads there."""

    name: str
    host_if: str
    inner_if: str

    @classmethod
    def create(cls, tag: str | None = None) -> PodNetwork:
        tag = tag or str(os.getpid())
        guard_pod_range()
        net = cls(name=f"{PREFIX}{tag}", host_if=f"efh{tag}"[:15], inner_if=f"efn{tag}"[:15])
        net.delete()  # a leftover from a killed run
        try:
            _ip("netns", "add", net.name)
            _ip("link", "add", net.host_if, "type", "veth", "peer", "name", net.inner_if)
            _ip("link", "set", net.inner_if, "netns", net.name)
            _ip("addr", "add", f"{HOST_ADDR}/32", "dev", net.host_if)
            _ip("link", "set", net.host_if, "up")
            net.exec("ip", "link", "set", "lo", "up")
            net.exec("ip", "addr", "add", f"{INNER_ADDR}/32", "dev", net.inner_if)
            net.exec("ip", "link", "set", net.inner_if, "up")
            net.exec("ip", "route", "add", f"{HOST_ADDR}/32", "dev", net.inner_if)
            net.exec("ip", "route", "add", "local", LOCAL_RANGE, "dev", "lo")
            _ip("route", "add", POD_CIDR, "dev", net.host_if)
        except subprocess.CalledProcessError as exc:
            net.delete()
            raise RuntimeError(f"building the pod network failed: {exc.stderr}") from exc
        return net

    def exec(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], capture_output=True, text=True,
                              check=True)

    def prefix(self) -> list[str]:
        """argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def delete(self) -> None:
        _ip("route", "del", POD_CIDR, "dev", self.host_if, check=False)
        _ip("route", "flush", "table", "local", "root", POD_CIDR, check=False)  # pod_ip_on_host leftovers
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "del", self.name, check=False)


@contextmanager
def pod_ip_on_host(ip: str) -> Iterator[str]:
    """While inside: `ip` (a pod IP of this process's POD_CIDR) is local to the root namespace, so a host
    process can listen on it and the operator's scrape of that pod reaches it; its own connections still
    leave from the host (API server on loopback, runtimes through the veth, source 198.19.255.254).

    A ``local`` route in the ``local`` table wins over the POD_CIDR route to the namespace for this one
    address; the rest of the range still leads there."""
    if ip_address(ip) not in ip_network(POD_CIDR):
        raise ValueError(f"{ip} is not in this test process's pod range {POD_CIDR}")
    _ip("route", "replace", "local", f"{ip}/32", "dev", "lo", "table", "local")
    try:
        yield ip
    finally:
        _ip("route", "del", "local", f"{ip}/32", "dev", "lo", "table", "local", check=False)
