"""The bounds that count what no single timeout or size sees: header lines (--max-headers, trailers
included), open connections per process (--max-connections), a body's average rate (--min-body-rate after
its first --body-timeout-seconds), and how far pipelined requests are parsed ahead (one, whatever the size
of the reads). Each against a real `embedfleet serve` and a real `embedfleet gateway` in front of it, with
real sockets; meanwhile the server's memory stays put and another client's /health is answered. And a
client that leaves is one log line in the runtime's log, not a traceback."""

from __future__ import annotations

import json
import time

import pytest

from tests.abuse import rawhttp
from tests.abuse.conftest import Target, gateway_to, wait_until
from tests.abuse.rawhttp import MIB
from tests.abuse.test_limits import HEAD_LIMIT, assert_calm
from tests.gateway.conftest import MODEL
from tests.procs import start_runtime

MAX_HEADERS = 100  # the documented default of --max-headers (not set here)
MAX_CONNECTIONS = 64  # --max-connections
BODY_S, MIN_RATE = 2, 200  # --body-timeout-seconds, --min-body-rate
GRACE_S = 1.0  # how late after its bound a cut may come
POST_HEAD = b"POST /v1/embeddings HTTP/1.1\r\nHost: abuse\r\nContent-Type: application/json\r\n"


FLAGS = ("--max-connections", str(MAX_CONNECTIONS), "--body-timeout-seconds", str(BODY_S),
         "--min-body-rate", str(MIN_RATE))


@pytest.fixture(scope="module")
def runtime():
    srv = start_runtime(*FLAGS)
    yield Target("runtime", srv)
    srv.stop()


@pytest.fixture(scope="module")
def gateway(runtime):
    srv = gateway_to(runtime.srv, *FLAGS)
    yield Target("gateway", srv)
    srv.stop()


@pytest.fixture(scope="module", params=["runtime", "gateway"])
def target(request) -> Target:
    return request.getfixturevalue(request.param)


def send_until_answered(sock, data: bytes, most: int) -> tuple[int, rawhttp.Drained]:
    """Write `data` again and again (up to `most` bytes) until the server answers or closes; what it said."""
    sent = 0
    while sent < most:
        if rawhttp.readable(sock):
            break
        try:
            sock.sendall(data)
        except OSError:
            return sent, rawhttp.Drained(b"", True, 0.0)
        sent += len(data)
    return sent, rawhttp.drain(sock, 5)


@pytest.mark.parametrize("trailer", [b"X-T: a\r\n", b"X-Long: " + b"a" * 65536],
                         ids=["many-lines", "one-long-line"])
def test_endless_trailers_are_refused_431_and_closed(target, trailer: bytes) -> None:
    """A chunked body, its last chunk, then trailer lines without end (up to 16 MB)."""
    body = json.dumps({"model": MODEL, "input": ["trailers follow"]}).encode()
    sock = rawhttp.connect(target.port, sndbuf=64 * 1024)
    with rawhttp.RssWatcher(target.pid) as rss, rawhttp.HealthProber(target.port) as prober:
        sock.sendall(POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + rawhttp.chunk(body) + b"0\r\n")
        sent, out = send_until_answered(sock, trailer * max(1, 65536 // len(trailer)), 16 * MIB)
        growth, probe = rss.stop(), prober.stop()
    sock.close()
    print(f"{len(trailer)}-byte trailer lines: {sent / MIB:.2f} MiB sent before an answer, statuses {out.statuses}, "
          f"closed {out.closed}, RSS +{growth / MIB:.1f} MiB, /health worst {probe.worst:.3f}s")
    assert out.closed, f"still open after {sent / MIB:.1f} MiB of trailers"
    assert out.statuses in ([], [431]), f"answered {out.statuses}: {out.data[:300]!r}"
    assert sent < 2 * MIB, f"the server read {sent / MIB:.1f} MiB of trailers"
    assert_calm(growth, probe, "endless trailers")
    target.still_serving()


def test_heads_of_many_tiny_headers_are_refused_431(target) -> None:
    """50 connections, each a 60 KB head of 15,000 empty headers (under the byte limit), held unfinished."""
    head = b"GET /health HTTP/1.1\r\nHost: abuse\r\n" + b"a:\r\n" * 15_000
    assert len(head) < HEAD_LIMIT
    with rawhttp.RssWatcher(target.pid) as rss, rawhttp.HealthProber(target.port) as prober:
        socks = [rawhttp.connect(target.port) for _ in range(50)]
        for sock in socks:
            sock.sendall(head)
        outs = [rawhttp.drain(sock, 3) for sock in socks]
        growth, probe = rss.stop(), prober.stop()
    for sock in socks:
        sock.close()
    seen = sorted({tuple(out.statuses) for out in outs})
    print(f"statuses {seen}, closed {sum(o.closed for o in outs)}/50, RSS +{growth / MIB:.1f} MiB, "
          f"/health worst {probe.worst:.3f}s")
    assert seen == [(431,)], f"answered {seen} (--max-headers {MAX_HEADERS})"
    assert all(out.closed for out in outs), "a connection stayed open after its 431"
    assert_calm(growth, probe, "heads of 15,000 headers")
    # a whole head just within the count is served
    fine = rawhttp.request("GET", "/health", {f"x-{i}": "1" for i in range(MAX_HEADERS - 1)})
    with rawhttp.connect(target.port) as sock:
        sock.sendall(fine)
        assert rawhttp.read_answer(sock, 10).status == 200


def test_connections_past_max_connections_do_not_hold_the_server(target) -> None:
    """200 connections each holding a stalled 60 KB head: the server keeps at most --max-connections
    open (closing the longest-quiet to make room), and a new client's /health is answered meanwhile."""
    before = rawhttp.fd_count(target.pid)
    head = b"GET /health HTTP/1.1\r\nHost: abuse\r\nX-Long: " + b"a" * 60_000
    socks = []
    with rawhttp.RssWatcher(target.pid) as rss, rawhttp.HealthProber(target.port) as prober:
        for _ in range(200):
            sock = rawhttp.connect(target.port)
            sock.sendall(head)
            socks.append(sock)
        time.sleep(0.5)
        peak = rawhttp.fd_count(target.pid)
        growth, probe = rss.stop(), prober.stop()
    closed = sum(rawhttp.drain(sock, 0.01).closed for sock in socks)
    for sock in socks:
        sock.close()
    print(f"fds {before} before, {peak} with 200 stalled heads open; {closed} of ours closed by the server; "
          f"RSS +{growth / MIB:.1f} MiB, /health worst {probe.worst:.3f}s over {len(probe.latencies)} polls")
    assert peak - before <= MAX_CONNECTIONS, f"{peak - before} more descriptors open (--max-connections " \
                                             f"{MAX_CONNECTIONS})"
    assert closed >= 200 - MAX_CONNECTIONS, f"only {closed} of 200 stalled connections closed"
    assert_calm(growth, probe, "200 stalled heads")
    target.still_serving()


def test_a_new_connection_gets_503_when_every_one_has_a_request_in_flight(target) -> None:
    """With every allowed connection holding a body under way, one more is answered 503 and closed, before
    any of those bodies reaches its --body-timeout-seconds (so the server answered it at once rather than
    waiting for a slot). A loaded machine that takes longer than that to set the scene voids the attempt
    (the bodies may have been cut, freeing a slot), and the scene is set again."""
    body_head = POST_HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"input": "'
    for _attempt in range(3):
        socks = []
        started = time.monotonic()  # before the first body: none of them is cut before started + BODY_S
        try:
            for _ in range(MAX_CONNECTIONS):
                sock = rawhttp.connect(target.port)
                sock.sendall(body_head)  # a body under way: a request in flight, never closed to make room
                socks.append(sock)
            time.sleep(0.3)
            with rawhttp.connect(target.port) as extra:
                extra.sendall(rawhttp.request("GET", "/health"))
                out = rawhttp.drain(extra, 5)
            still_open = not any(rawhttp.drain(sock, 0).closed for sock in socks)
            in_time = time.monotonic() - started < BODY_S
        finally:
            for sock in socks:
                sock.close()
        assert wait_until(lambda: rawhttp.get(target.port, "/health").status == 200, within=5)
        if in_time:
            break
    print(f"the extra connection: statuses {out.statuses}, closed {out.closed}")
    assert in_time, (f"three attempts each took over {BODY_S}s: the server held the extra connection (answered "
                     f"{out.statuses}), or this machine is too slow to judge it")
    assert out.statuses == [503] and out.closed, f"answered {out.statuses}: {out.data[:300]!r}"
    assert still_open, "a body under way was closed"


def test_a_body_slower_than_min_body_rate_is_cut(target) -> None:
    """One byte every 0.5 s: no gap reaches --body-timeout-seconds, the rate is far under --min-body-rate."""
    sock = rawhttp.connect(target.port)
    sock.sendall(POST_HEAD + b"Content-Length: 1000\r\n\r\n")
    start, sent, out = time.monotonic(), 0, rawhttp.Drained(b"", False, 0.0)
    while time.monotonic() - start < 4 * (BODY_S + GRACE_S):
        try:
            sock.sendall(b" ")
        except OSError:
            out = rawhttp.Drained(b"", True, 0.0)
            break
        sent += 1
        if rawhttp.readable(sock, 0.5):
            out = rawhttp.drain(sock, 2)
            break
    ended = time.monotonic() - start
    sock.close()
    bound = BODY_S + sent / MIN_RATE + GRACE_S
    print(f"{sent} body bytes in {ended:.2f}s; statuses {out.statuses}, closed {out.closed} (bound {bound:.2f}s)")
    assert out.closed, f"a {sent / ended:.1f} bytes/s body still open after {ended:.1f}s"
    assert ended <= bound, f"cut after {ended:.2f}s, not by {bound:.2f}s"
    assert out.statuses in ([], [408]), f"answered {out.statuses}: {out.data[:300]!r}"
    target.still_serving()


def test_pipelined_requests_in_one_small_write_are_answered_in_order(target) -> None:
    """145 `GET /health` and a malformed request in one write under 4 KB, on 20 connections at once: every
    request before the malformed one is answered, in order, then its 400 (parsing everything at once
    found the 400 first, and the answers before it were lost)."""
    one = b"GET /health HTTP/1.1\r\n\r\n"
    burst = one * 145 + b"GET /health HTTP/1.1 junk\r\n\r\n"
    assert len(burst) <= 4096
    with rawhttp.RssWatcher(target.pid) as rss, rawhttp.HealthProber(target.port) as prober:
        socks = [rawhttp.connect(target.port) for _ in range(20)]
        for sock in socks:
            sock.sendall(burst)
        outs = [rawhttp.drain(sock, 10) for sock in socks]
        growth, probe = rss.stop(), prober.stop()
    for sock in socks:
        sock.close()
    seen = {tuple(out.statuses) for out in outs}
    print(f"statuses per connection: {sorted((s.count(200), s[-1:]) for s in seen)}, RSS +{growth / MIB:.1f} MiB")
    assert seen == {(200,) * 145 + (400,)}, f"answered {[(s.count(200), s[-1:]) for s in seen]}"
    assert_calm(growth, probe, "pipelined bursts")


def test_clients_that_leave_are_one_info_line_each(target) -> None:
    """Clients that reset mid-body or send a malformed head: no traceback, no error, one line each at most,
    from the runtime and from the gateway in front of one."""
    runtime = target
    body = json.dumps({"model": MODEL, "input": ["a sentence to embed"] * 64}).encode()
    log_before = len(runtime.srv.log())
    for _ in range(20):
        sock = rawhttp.connect(runtime.port)
        sock.sendall(POST_HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
        time.sleep(0.05)
        rawhttp.reset(sock)
    for _ in range(20):
        with rawhttp.connect(runtime.port) as sock:
            sock.sendall(b"GET /health HTTP/1.1 junk\r\n\r\n")
            rawhttp.drain(sock, 5)
    time.sleep(1.0)
    runtime.still_serving()
    logged = runtime.srv.log()[log_before:]
    lines = [line for line in logged.splitlines() if line.strip()]
    print(f"{len(lines)} log lines for 40 clients that left or sent a malformed head:\n" + "\n".join(lines[:5]))
    assert "Traceback" not in logged and "unexpected error" not in logged, logged[:3000]
    assert not [line for line in lines if " ERROR " in line or " WARNING " in line], logged[:3000]
    assert len(lines) <= 40, f"{len(lines)} lines for 40 clients"
