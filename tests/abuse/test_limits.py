"""Bounds on what one client can make a server hold: the request head (64 KiB, then 431 and close), the
answers of pipelined requests it never reads, and the request body (--payload-limit, then 413 while the
client is still sending, and close). Meanwhile the server's memory stays put and other connections'
/health stays fast."""

from __future__ import annotations

import select
import time

import pytest

from tests.abuse import rawhttp
from tests.abuse.conftest import SPLIT_FRONTS, Target, gateway_to
from tests.abuse.rawhttp import MIB
from tests.procs import start_runtime

LIMIT = 1_000_000  # --payload-limit
HEAD_LIMIT = 64 * 1024
RSS_GROWTH_MAX = 30 * MIB
LATENCY_MAX_S = 0.5


@pytest.fixture(scope="module")
def runtime():
    srv = start_runtime("--payload-limit", str(LIMIT))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gateway(runtime):
    srv = gateway_to(runtime, "--payload-limit", str(LIMIT))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def split():
    srv = start_runtime("--payload-limit", str(LIMIT), *SPLIT_FRONTS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["runtime", "gateway", "split"])
def target(request) -> Target:
    return Target(request.param, request.getfixturevalue(request.param))


def assert_calm(growth: int, probe: rawhttp.Probe, what: str) -> None:
    """The server's RSS grew less than 30 MB and no other connection's /health took 0.5 s."""
    assert growth < RSS_GROWTH_MAX, f"RSS grew {growth / MIB:.1f} MiB during {what}"
    assert not probe.failures, f"/health failed during {what}: {probe.failures[:3]}"
    assert probe.worst < LATENCY_MAX_S, \
        f"/health took up to {probe.worst:.3f}s during {what} ({len(probe.latencies)} polls)"


def test_pipelined_requests_never_read_do_not_pile_up(target: Target) -> None:
    """One connection writes pipelined `GET /health` as fast as it can for 5 s and never reads. (First in
    this module: RSS is measured against a heap no earlier case has grown.)"""
    burst = rawhttp.request("GET", "/health") * 256
    sock = rawhttp.connect(target.port)
    sock.setblocking(False)
    sent, cut = 0, False
    with rawhttp.RssWatcher(target.pid) as rss, rawhttp.HealthProber(target.port) as prober:
        time.sleep(0.2)
        end = time.monotonic() + 5
        while time.monotonic() < end:
            _, writable, _ = select.select([], [sock], [], 0.1)
            if writable:
                try:
                    sent += sock.send(burst)
                except BlockingIOError:
                    pass
                except OSError:
                    cut = True
                    break
        growth_open = max(rss.peak, rawhttp.rss_bytes(target.pid)) - rss.baseline
        rawhttp.reset(sock)
        time.sleep(1.0)
        growth_after = rawhttp.rss_bytes(target.pid) - rss.baseline
        growth = rss.stop()
        probe = prober.stop()
    requests = sent // len(rawhttp.request("GET", "/health"))
    print(f"{target.kind}: {requests} requests written ({sent / MIB:.1f} MiB), cut by the server: {cut}, "
          f"RSS +{growth_open / MIB:.1f} MiB while open, +{growth_after / MIB:.1f} MiB after close, "
          f"peak +{growth / MIB:.1f} MiB, /health worst {probe.worst:.3f}s over {len(probe.latencies)} polls, "
          f"{len(probe.failures)} failures")
    assert growth_after < RSS_GROWTH_MAX, f"RSS still {growth_after / MIB:.1f} MiB up after the connection closed"
    assert_calm(growth, probe, "5 s of pipelined requests never read")
    target.still_serving()


def test_an_unfinished_head_is_refused_431_and_closed_at_64_kib(target: Target) -> None:
    """One header line that never ends, written as fast as the server reads, up to 64 MB."""
    sock = rawhttp.connect(target.port, sndbuf=64 * 1024)
    filler = b"a" * 65536
    sent, answer, closed = 0, b"", False
    with rawhttp.RssWatcher(target.pid) as rss, rawhttp.HealthProber(target.port) as prober:
        time.sleep(0.2)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: abuse\r\nX-Long: ")
        sock.setblocking(False)
        deadline = time.monotonic() + 30
        while sent < 64 * MIB and time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                got = rawhttp.recv_some(sock, 0)
                if got:
                    answer += got
                closed = not got
                break
            if writable:
                try:
                    sent += sock.send(filler)
                except BlockingIOError:
                    pass
                except OSError:
                    closed = True
                    break
        sent_before_answer = sent
        sock.setblocking(True)
        rest = rawhttp.drain(sock, 10) if not closed else rawhttp.Drained(b"", True, 0.0)
        time.sleep(0.2)
        growth = rss.stop()
        probe = prober.stop()
    sock.close()
    seen = rawhttp.statuses(answer + rest.data)
    print(f"{target.kind}: sent {sent_before_answer / MIB:.2f} MiB before an answer or close, statuses {seen}, "
          f"closed {closed or rest.closed}, RSS +{growth / MIB:.1f} MiB, /health worst {probe.worst:.3f}s "
          f"over {len(probe.latencies)} polls, {len(probe.failures)} failures")
    assert seen[:1] == [431], f"answered {seen} ({(answer + rest.data)[:200]!r}) after {sent_before_answer} bytes"
    assert sent_before_answer < 2 * MIB, f"the server read {sent_before_answer / MIB:.1f} MiB of one head"
    assert closed or rest.closed, "the connection stayed open after the 431"
    assert_calm(growth, probe, "a 64 MB head")
    target.still_serving()


def test_a_chunked_body_over_the_limit_is_refused_413_while_it_is_sent(target: Target) -> None:
    """64 KiB every 20 ms past --payload-limit: the 413 comes before twice the limit is sent."""
    sock = rawhttp.connect(target.port)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: abuse\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"a" * 65536
    sent, answer, closed = 0, b"", False
    while sent < 8 * LIMIT:
        got = rawhttp.recv_some(sock, 0.02)
        if got is not None:
            answer, closed = got, not got
            break
        try:
            sock.sendall(rawhttp.chunk(piece))
        except OSError:  # reset, or the server stopped reading for 10 s
            closed = True
            break
        sent += len(piece)
    sent_before_answer = sent
    if not answer and not closed:  # never refused: end the body and see what comes
        try:
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            closed = True
    rest = rawhttp.drain(sock, 10) if not closed else rawhttp.Drained(b"", True, 0.0)
    sock.close()
    seen = rawhttp.statuses(answer + rest.data)
    print(f"{target.kind}: {sent_before_answer} body bytes sent before an answer or close (limit {LIMIT}), "
          f"statuses {seen}, closed {closed or rest.closed}")
    assert seen[:1] == [413], f"answered {seen}: {(answer + rest.data)[:300]!r}"
    assert sent_before_answer < 2 * LIMIT, f"the 413 came only after {sent_before_answer} bytes of body"
    assert closed or rest.closed, "the connection stayed open after the 413"
    target.still_serving()


def test_a_declared_length_over_the_limit_is_refused_413_before_the_body(target: Target) -> None:
    sock = rawhttp.connect(target.port)
    sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: abuse\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {5 * LIMIT}\r\n\r\n".encode())
    out = rawhttp.drain(sock, 10)
    sock.close()
    print(f"{target.kind}: statuses {out.statuses}, closed {out.closed} after {out.seconds:.2f}s, no body sent")
    assert out.statuses[:1] == [413], f"answered {out.statuses}: {out.data[:300]!r}"
    assert out.closed, "the connection stayed open after the 413"
    target.still_serving()
