"""Hostile framing: requests that two parsers could read two ways (smuggling), header bytes no request may
carry, a malformed request line; clients that vanish mid-request; many idle connections at once. Each is
refused or survived, and the server goes on serving."""

from __future__ import annotations

import json
import time

import pytest

from tests.abuse import rawhttp
from tests.abuse.conftest import SPLIT_FRONTS, Target, gateway_to, wait_until
from tests.gateway.conftest import MODEL
from tests.procs import start_runtime

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: abuse\r\n\r\n"
CL_BODY = b"0\r\n\r\n" + SMUGGLED
TE_BODY = b"%x\r\n%b\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED)
IDLE_CONNECTIONS = 500


@pytest.fixture(scope="module")
def runtime():
    srv = start_runtime()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gateway(runtime):
    srv = gateway_to(runtime)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def split():
    srv = start_runtime(*SPLIT_FRONTS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["runtime", "gateway", "split"])
def target(request) -> Target:
    return Target(request.param, request.getfixturevalue(request.param))


def post_head(*headers: str) -> bytes:
    return ("\r\n".join(["POST /v1/embeddings HTTP/1.1", "Host: abuse", "Content-Type: application/json",
                         *headers]) + "\r\n\r\n").encode()


HOSTILE = {
    # Content-Length first, then chunked: by length one request, by chunks a second one (GET /health) after it.
    "cl_te": post_head(f"Content-Length: {len(CL_BODY)}", "Transfer-Encoding: chunked") + CL_BODY,
    # chunked first, then a Content-Length covering the chunk-size line only: by length, a second request.
    "te_cl": post_head("Transfer-Encoding: chunked", f"Content-Length: {len(b'%x' % len(SMUGGLED)) + 2}") + TE_BODY,
    # two lengths: by the first one request, by the second its body holds another (GET /health).
    "cl_cl": post_head(f"Content-Length: {len(SMUGGLED)}", "Content-Length: 0") + SMUGGLED,
    "obs_fold": b"GET /health HTTP/1.1\r\nHost: abuse\r\nX-Folded: one\r\n two\r\n\r\n",
    "nul_in_value": b"GET /health HTTP/1.1\r\nHost: abuse\r\nX-Nul: a\x00b\r\n\r\n",
    "bare_cr_in_value": b"GET /health HTTP/1.1\r\nHost: abuse\r\nX-Cr: a\rb\r\n\r\n",
    "request_line_trailing_junk": b"GET /health HTTP/1.1 junk\r\nHost: abuse\r\n\r\n",
    "request_line_not_http": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(32) + b"\r\n\r\n",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_framing_is_refused_400_and_closed(target: Target, case: str) -> None:
    """One 400, then the connection ends: never a second answer for what a framing could read as another
    request."""
    sock = rawhttp.connect(target.port)
    sock.sendall(HOSTILE[case])
    out = rawhttp.drain(sock, 10)
    sock.close()
    print(f"{target.kind} {case}: statuses {out.statuses}, closed {out.closed} after {out.seconds:.2f}s")
    assert out.statuses == [400], f"answered {out.statuses}: {out.data[:400]!r}"
    assert out.closed, "the connection stayed open after the 400"
    target.still_serving()


def test_clients_that_vanish_mid_request_leave_nothing_in_flight(target: Target) -> None:
    """Resets mid-body, and right after a whole (small) request whose answer is never read: the in-flight
    count returns to zero. (Small, so that this holds whether or not the server stops work whose client
    left: that it does is not asked here.)"""
    big = json.dumps({"model": MODEL, "input": ["a sentence to embed, several times over"] * 64}).encode()
    small = json.dumps({"model": MODEL, "input": ["a short one"]}).encode()
    for _ in range(5):
        sock = rawhttp.connect(target.port)
        sock.sendall(post_head(f"Content-Length: {len(big)}") + big[:len(big) // 2])
        time.sleep(0.05)
        rawhttp.reset(sock)
    for _ in range(5):
        sock = rawhttp.connect(target.port)
        sock.sendall(post_head(f"Content-Length: {len(small)}") + small)
        time.sleep(0.01)
        rawhttp.reset(sock)
    drained = wait_until(lambda: target.in_flight() == 0, within=15, every=0.1)
    print(f"{target.kind}: in flight {target.in_flight()} after the resets")
    assert drained, f"still {target.in_flight()} requests in flight 15 s after their clients left"
    target.still_serving()


def test_many_idle_connections_are_released_when_closed(target: Target) -> None:
    before = rawhttp.fd_count(target.pid)
    socks = [rawhttp.connect(target.port) for _ in range(IDLE_CONNECTIONS)]
    try:
        wait_until(lambda: rawhttp.fd_count(target.pid) >= before + IDLE_CONNECTIONS, within=5)
        peak = rawhttp.fd_count(target.pid)
        target.still_serving()  # with them all open
    finally:
        for sock in socks:
            sock.close()
    released = wait_until(lambda: rawhttp.fd_count(target.pid) <= before + 10, within=15, every=0.1)
    after = rawhttp.fd_count(target.pid)
    print(f"{target.kind}: fds {before} before, {peak} with {IDLE_CONNECTIONS} idle connections, {after} after")
    assert released, f"{after} fds open 15 s after closing {IDLE_CONNECTIONS} connections ({before} before)"
    target.still_serving()
