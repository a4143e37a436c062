"""Webhooks: which URLs we accept, where a delivery connects, how it is signed, when it is retried.

A webhook URL is user input that makes our server send requests, so its destination must be an
address the public internet routes to: `ipaddress`' `is_global`, minus multicast, site-local and
the IPv6 forms that embed an IPv4 address (mapped, 6to4, NAT64), which count as their IPv4 address.
Everything else (private, loopback, link-local, CGNAT 100.64.0.0/10, 192.0.0.0/24, benchmarking
198.18.0.0/15, documentation, reserved, ...) is refused unless the operator opts in with
`--webhook-allow-private` (for tests and for receivers on a private network), or any tenant could
probe internal services.

The check runs at submission (a clear 422) and again at delivery, where the host is resolved once,
every address it resolves to is checked, and the connection goes to a checked address (`Target`):
a DNS answer that changes between the check and the connection (rebinding) cannot redirect it.

Signature (as Stripe and Standard Webhooks do it): HMAC-SHA256 over `"{timestamp}." + body` with
the shared secret, so a captured delivery cannot be replayed with a fresh timestamp.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

SIGNATURE_HEADER = "X-Embedfleet-Signature"  # "v1=" + hex HMAC-SHA256(secret, f"{timestamp}." + body)
TIMESTAMP_HEADER = "X-Embedfleet-Timestamp"  # unix seconds when this delivery was signed
JOB_HEADER = "X-Embedfleet-Job-Id"
ATTEMPT_HEADER = "X-Embedfleet-Attempt"

NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known prefix: the last 32 bits are an IPv4 address
# refused whatever this Python's `is_global` says of them (its tables differ between releases):
REFUSED_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "100.64.0.0/10",  # shared address space (carrier-grade NAT): inside a provider
    "192.0.0.0/24",  # IETF protocol assignments (incl. the anycast relays some releases call global)
    "198.18.0.0/15",  # benchmarking
    "::/96",  # deprecated IPv4-compatible ::a.b.c.d, which `is_global` calls global
    "64:ff9b:1::/48",  # local-use NAT64 prefix (RFC 8215)
    "2001::/23",  # IETF protocol assignments (Teredo, ORCHID, AMT, ...)
))


class WebhookRefused(ValueError):
    """The URL may not be used as a webhook target; the message says why."""


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for, where packets to it reach that IPv4 address."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(address: str) -> bool:
    """True only for an address the public internet routes to (unicast, globally reachable)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        inner = embedded_ipv4(ip)
        if inner is not None:
            return is_public(str(inner))
        if ip.is_site_local:
            return False
    if any(ip.version == net.version and ip in net for net in REFUSED_NETWORKS):
        return False
    return ip.is_global and not ip.is_multicast and not ip.is_reserved


def is_internal(address: str) -> bool:
    return not is_public(address)


def check_scheme(url: str) -> tuple[str, int]:
    """(host, port) of an acceptable URL's destination; raises WebhookRefused otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookRefused(f"webhook_url is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookRefused(f"webhook_url must be http or https, not {parts.scheme or 'schemeless'!r}")
    if not parts.hostname:
        raise WebhookRefused("webhook_url has no host")
    if parts.username or parts.password:
        raise WebhookRefused("webhook_url must not carry credentials; the delivery is signed instead")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class Target:
    """A webhook URL and the addresses it was checked against: a delivery connects only to those."""

    url: str
    host: str
    port: int
    addresses: tuple[str, ...]


async def resolve_webhook(url: str, allow_private: bool) -> Target:
    """Resolve the URL's host once and check every address; raises WebhookRefused when one is not public.

    Every address is checked, not just the first, because the connection may go to any of them.
    """
    host, port = check_scheme(url)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise WebhookRefused(f"webhook_url host {host!r} does not resolve: {exc}") from None
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise WebhookRefused(f"webhook_url host {host!r} does not resolve")
    if not allow_private:
        for address in addresses:
            if not is_public(address):
                raise WebhookRefused(
                    f"webhook_url host {host!r} resolves to {address}, which is not a public (global unicast) "
                    "address; private, loopback and other non-global destinations need --webhook-allow-private")
    return Target(url, host, port, addresses)


async def check_webhook_url(url: str, allow_private: bool) -> str:
    """The URL if it may receive deliveries (checked as `resolve_webhook` does)."""
    return (await resolve_webhook(url, allow_private)).url


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    return "v1=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def verify(secret: bytes, timestamp: str, body: bytes, signature: str, tolerance: float = 300,
           now: float | None = None) -> bool:
    """What a receiver does: the signature matches and the timestamp is fresh."""
    try:
        age = abs((time.time() if now is None else now) - int(timestamp))
    except ValueError:
        return False
    return age <= tolerance and hmac.compare_digest(sign(secret, timestamp, body), signature)


def retry_delay(attempt: int, base: float, cap: float = 600.0) -> float:
    """Seconds to wait after failed delivery number `attempt` (1-based): base, 2*base, 4*base, ... capped."""
    return min(cap, base * 2 ** min(attempt - 1, 40))


def signed_headers(secret: bytes, body: bytes, job_id: str, attempt: int) -> dict[str, str]:
    timestamp = str(int(time.time()))
    return {"content-type": "application/json", SIGNATURE_HEADER: sign(secret, timestamp, body),
            TIMESTAMP_HEADER: timestamp, JOB_HEADER: job_id, ATTEMPT_HEADER: str(attempt),
            "user-agent": "embedfleet-webhook/1"}
