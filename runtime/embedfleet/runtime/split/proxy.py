"""The routes a front does not serve itself, passed to the engine process's own application.

A front serves the routes that are the traffic (embeddings, rerank, classify, sparse, tokenize, the
probes); the rest read the engine's state (the model cards with their gates and batching, the probe-set
outputs, int8 quantization ranges, per-token outputs) or are rare (async jobs), and are passed whole to
the engine's application on its private Unix socket, where the same gate and routes answer them. /metrics
goes there too: the engine adds up every process's series (Prometheus multiprocess mode).

The front's gate has already checked the key, the payload limit and draining; the engine's checks them
again, so nothing reaches the engine that a single-process server would have refused.
"""

from __future__ import annotations

import logging

import httpx
from starlette.responses import Response

from embedfleet.runtime.api.errors import error_response

log = logging.getLogger(__name__)
PREFIXES = ("/v1/models", "/metrics", "/embed_all", "/async/")
HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host", b"upgrade",
                 b"te", b"trailer", b"proxy-authorization", b"proxy-connection"})
# hop-by-hop, and what the front's own gate stamps on the answer (load, timing, the vector space served)
DROP_ANSWER = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                         "date", "server-timing", "x-embedfleet-expected-wait", "x-total-time", "x-tokenization-time",
                         "x-queue-time", "x-inference-time", "x-embedfleet-vector-space", "x-embedfleet-revision"})
TIMEOUT_S = 600.0  # the engine's own bounds (deadlines, queue bounds, drain) end a request long before this


def proxied(path: str) -> bool:
    """A path the engine answers. Not one with `.` or `..` segments: the HTTP client would resolve them into
    another path, where the single process matches no route (the front's own router answers it: 404)."""
    return path.startswith(PREFIXES) and not any(part in (".", "..") for part in path.split("/"))


class ProxyRoutes:
    """ASGI: the paths `proxied` names go to the engine's application at `uds`; the rest to `app`."""

    def __init__(self, app, uds: str, payload_limit: int) -> None:
        self.app = app
        self.uds = uds
        self.payload_limit = payload_limit  # GET and open paths pass the gate uncounted: bounded here too
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.uds),
                                             base_url="http://engine", timeout=TIMEOUT_S)
        return self._client

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not proxied(scope["path"]):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.payload_limit:
                response = error_response(413, f"request body is over the payload limit of {self.payload_limit} "
                                          "bytes", "payload_too_large", {"connection": "close"})
                await response(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        raw = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            raw += b"?" + scope["query_string"]
        client = self.client()
        try:  # the path's bytes as received, not decoded and encoded again
            answer = await client.request(scope["method"], client.base_url.copy_with(raw_path=raw), headers=headers,
                                          content=bytes(body))
        except httpx.HTTPError as exc:
            log.warning("the engine did not answer %s %s: %s", scope["method"], scope["path"], exc)
            response = error_response(503, "the engine process is not answering; retry shortly", "engine_unavailable",
                                      {"retry-after": "1"})
        else:
            response = Response(answer.content, status_code=answer.status_code,
                                headers={k: v for k, v in answer.headers.items() if k.lower() not in DROP_ANSWER})
        await response(scope, receive, send)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
