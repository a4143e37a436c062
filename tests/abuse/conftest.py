"""The servers under abuse: a real runtime (embedded default model) and a real gateway in front of a
real runtime, started as a user starts them. Every test runs against both (`target`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tests.abuse import rawhttp
from tests.gateway.conftest import MODEL, start_gateway
from tests.procs import RuntimeServer

IN_FLIGHT = {"runtime": "embedfleet_requests_in_flight", "gateway": "embedfleet_gateway_requests_in_flight",
             "split": "embedfleet_requests_in_flight"}
SPLIT_FRONTS = ("--fronts", "2")  # the runtime as a split server: a supervisor, an engine and two fronts


@dataclass
class Target:
    """One server under test: `runtime`, `gateway`, or `split` (the runtime with front processes)."""

    kind: str
    srv: RuntimeServer

    @property
    def port(self) -> int:
        return self.srv.port

    @property
    def pid(self) -> int:
        return self.srv.proc.pid

    def in_flight(self) -> float:
        """Requests the server counts as in flight (/metrics); 0 while the gauge has no sample."""
        try:
            return self.srv.metric(IN_FLIGHT[self.kind])
        except KeyError:
            return 0.0

    def still_serving(self) -> None:
        """The process is alive and a new connection's `GET /health` is answered 200."""
        assert self.srv.proc.poll() is None, f"{self.kind} exited with {self.srv.proc.returncode}:\n" \
                                             f"{self.srv.log()[-3000:]}"
        answer = rawhttp.get(self.port, "/health", timeout=10)
        assert answer.status == 200, f"{self.kind} /health answered {answer.status}: {answer.body[:300]!r}"


def gateway_to(upstream: RuntimeServer, *flags: str) -> RuntimeServer:
    return start_gateway("--upstream", f"{MODEL}={upstream.url}", *flags)


def wait_until(check, within: float, every: float = 0.05) -> bool:
    """Poll `check` until it is true (True) or `within` seconds pass (False)."""
    deadline = time.monotonic() + within
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
