"""Node agents prove to each other that they are the release's agents: an HMAC key shared by the agents only.

The chart generates one random key per release, in a Secret mounted only into the node-agent DaemonSet
(``--peer-key-file``). Each request from one agent to another carries, in headers, the time (unix
seconds), a random nonce and ``HMAC-SHA256(key, METHOD \\n raw path \\n time \\n nonce)``; the serving agent
answers 401 with nothing else unless the signature matches, the time is within `WINDOW_S` of its own clock
and the nonce was not seen in that window. Its listings (the JSON answers: a weight entry's manifest, an
engines folder's builds) carry ``HMAC-SHA256(key, "body" \\n nonce \\n body)``, bound to the request's nonce,
which the fetching agent checks before it reads them: a process without the key can neither read a
tenant's weights or builds from an agent nor answer in an agent's place with a listing of its own (files
are then checked against the signed listing's sizes and sha256, and weights against their digest).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Generator
from pathlib import Path

import httpx

TIME = "X-Embedfleet-Peer-Time"
NONCE = "X-Embedfleet-Peer-Nonce"
SIGNATURE = "X-Embedfleet-Peer-Signature"
BODY_SIGNATURE = "X-Embedfleet-Peer-Body-Signature"
#: How far a request's time may be from the server's clock (seconds, either way).
WINDOW_S = 60
#: Nonces remembered to refuse a replayed request (more than this within the window: the oldest go).
MAX_NONCES = 100_000
_NONCE = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PeerKey:
    """The release's shared peer key (at least 32 bytes)."""

    def __init__(self, secret: bytes) -> None:
        secret = secret.strip()
        if len(secret) < 32:
            raise ValueError(f"a peer key needs at least 32 bytes, this one has {len(secret)}")
        self._secret = secret

    @classmethod
    def from_file(cls, path: Path) -> PeerKey:
        return cls(path.read_bytes())

    def _mac(self, *parts: bytes) -> str:
        return hmac.new(self._secret, b"\n".join(parts), hashlib.sha256).hexdigest()

    def request_signature(self, method: str, raw_path: str, at: str, nonce: str) -> str:
        return self._mac(method.upper().encode(), raw_path.encode("latin-1"), at.encode(), nonce.encode())

    def body_signature(self, nonce: str, body: bytes) -> str:
        return self._mac(b"body", nonce.encode(), body)


class Refused(Exception):
    """A request without valid peer credentials (the server answers 401)."""


class Verifier:
    """The serving side: checks a request's headers (`check`) and signs an answer's body (`sign_body`)."""

    def __init__(self, key: PeerKey, clock=time.time) -> None:
        self.key, self.clock = key, clock
        self._seen: dict[str, float] = {}

    def check(self, method: str, raw_path: str, headers) -> str:
        """The request's nonce when its credentials are valid; Refused otherwise."""
        at, nonce, signature = headers.get(TIME, ""), headers.get(NONCE, ""), headers.get(SIGNATURE, "")
        if not (at.isdigit() and _NONCE.match(nonce) and _HEX64.match(signature)):
            raise Refused("no peer credentials")
        now = self.clock()
        if abs(now - int(at)) > WINDOW_S:
            raise Refused("a request time outside the window")
        expected = self.key.request_signature(method, raw_path, at, nonce)
        if not hmac.compare_digest(expected, signature):
            raise Refused("a wrong signature")
        for old in [n for n, until in self._seen.items() if until < now]:
            del self._seen[old]
        if nonce in self._seen:
            raise Refused("a replayed request")
        if len(self._seen) >= MAX_NONCES:
            self._seen.pop(next(iter(self._seen)))
        self._seen[nonce] = now + 2 * WINDOW_S
        return nonce

    def sign_body(self, nonce: str, body: bytes) -> str:
        return self.key.body_signature(nonce, body)


class SignedRequests(httpx.Auth):
    """httpx auth for requests to another agent: signs each request; `verify` checks a listing's body."""

    def __init__(self, key: PeerKey) -> None:
        self.key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        at, nonce = str(int(time.time())), secrets.token_hex(16)
        raw_path = request.url.raw_path.decode("latin-1")
        request.headers[TIME] = at
        request.headers[NONCE] = nonce
        request.headers[SIGNATURE] = self.key.request_signature(request.method, raw_path, at, nonce)
        yield request

    def verify(self, response: httpx.Response) -> bool:
        """Whether ``response``'s body is signed with the key for the nonce of the request it answers."""
        nonce = response.request.headers.get(NONCE, "")
        got = response.headers.get(BODY_SIGNATURE, "")
        return bool(nonce) and hmac.compare_digest(self.key.body_signature(nonce, response.content), got)


def client(timeout: float, key: PeerKey | None) -> httpx.Client:
    """The HTTP client one agent asks another with: requests signed when there is a key."""
    return httpx.Client(timeout=timeout, headers={"accept-encoding": "identity"},
                        auth=SignedRequests(key) if key is not None else None)
