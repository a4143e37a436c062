"""A minimal real runtime stand-in: serves the runtime's metric contract over HTTP, nothing else.

Used where a test needs pods whose load it controls exactly (the autoscaler end to end), which the
real runtime only gives under real traffic. ``POST /set`` with ``{"in_flight": N}`` sets the gauge
(and ``"async_depth"`` the async backlog; ``"probe_cosine"`` / ``"probe_order_kept"`` the periodic probe
re-check's gauges for model ``"model"``, absent until first set, as on a runtime that has not re-checked);
``GET /metrics`` is prometheus_client's own exposition; ``/health`` and ``/ready`` answer 200.

    python tests/operator/fake_runtime_metrics.py --port 0   # prints "listening on PORT"
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

REGISTRY = CollectorRegistry()
IN_FLIGHT = Gauge("embedfleet_requests_in_flight", "requests accepted, not answered", registry=REGISTRY)
QUEUE = Gauge("embedfleet_queue_requests", "requests waiting for a batch", registry=REGISTRY)
MAX_BATCH = Gauge("embedfleet_max_batch_requests", "configured batch size", registry=REGISTRY)
ASYNC_DEPTH: list[Gauge] = []  # registered on first use: a runtime without Redis does not export it
PROBE: dict[str, Gauge] = {}  # likewise: no probe gauges before the first re-check


class Handler(BaseHTTPRequestHandler):
    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif self.path in ("/health", "/ready"):
            self._send(200, b'{"status": "ok"}')
        else:
            self._send(404, b'{"error": {"message": "not found", "type": "not_found", "code": 404}}')

    def do_POST(self) -> None:
        if self.path != "/set":
            self._send(404, b'{"error": {"message": "not found", "type": "not_found", "code": 404}}')
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            value = float(body["in_flight"])
            IN_FLIGHT.set(value)
            QUEUE.set(float(body.get("queue", 0)))
            if "async_depth" in body:
                if not ASYNC_DEPTH:
                    ASYNC_DEPTH.append(Gauge("embedfleet_async_queue_depth", "unfinished async jobs",
                                             registry=REGISTRY))
                ASYNC_DEPTH[0].set(float(body["async_depth"]))
            for key in ("probe_cosine", "probe_order_kept"):
                if key in body:
                    if key not in PROBE:
                        PROBE[key] = Gauge(f"embedfleet_{key}", "periodic probe re-check", ["model"],
                                           registry=REGISTRY)
                    PROBE[key].labels(str(body.get("model", "minilm"))).set(float(body[key]))
        except (ValueError, KeyError, TypeError) as exc:
            msg = json.dumps({"error": {"message": str(exc), "type": "invalid_request", "code": 400}})
            self._send(400, msg.encode())
            return
        self._send(200, json.dumps({"in_flight": value}).encode())

    def log_message(self, *args: object) -> None:
        return


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-batch-requests", type=int, default=32)
    args = parser.parse_args()
    MAX_BATCH.set(args.max_batch_requests)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
