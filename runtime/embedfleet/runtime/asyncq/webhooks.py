"""Webhooks: which URLs we accept, how a delivery is signed, and when a failed one is retried.

A webhook URL is user input that makes our server send requests: only http(s), and destinations
inside the cluster (private, loopback, link-local, ...) only when the operator opts in, or any
tenant could probe internal services. The check runs at submission (a clear 422) and again at
delivery, since DNS can change in between.

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
from urllib.parse import urlsplit

SIGNATURE_HEADER = "X-Embedfleet-Signature"  # "v1=" + hex HMAC-SHA256(secret, f"{timestamp}." + body)
TIMESTAMP_HEADER = "X-Embedfleet-Timestamp"  # unix seconds when this delivery was signed
JOB_HEADER = "X-Embedfleet-Job-Id"
ATTEMPT_HEADER = "X-Embedfleet-Attempt"


class WebhookRefused(ValueError):
    """The URL may not be used as a webhook target; the message says why."""


def is_internal(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
            or ip.is_unspecified)


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


async def check_webhook_url(url: str, allow_private: bool) -> str:
    """The URL if it may receive deliveries; resolves the host to see where it really points."""
    host, port = check_scheme(url)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise WebhookRefused(f"webhook_url host {host!r} does not resolve: {exc}") from None
    if not allow_private:
        for info in infos:
            address = info[4][0]
            if is_internal(address):
                raise WebhookRefused(
                    f"webhook_url host {host!r} resolves to internal address {address}; private and loopback "
                    "destinations need --webhook-allow-private")
    return url


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
