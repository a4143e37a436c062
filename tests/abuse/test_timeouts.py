"""The connection timeouts, each a flag on both servers and each refreshed by progress:
--head-timeout-seconds (longest gap between bytes of a request head), --head-total-seconds (the whole
head, from its first byte), --body-timeout-seconds (a body that stops moving), --keep-alive-seconds (an
idle connection between requests). Started small here, so that what each cuts is seen in seconds, and
so that a client that keeps moving for longer than all of them is seen not to be cut (--min-body-rate is
set under the slow upload's rate here; tests/abuse/test_bounds.py holds a body to it)."""

from __future__ import annotations

import json
import time
from itertools import pairwise

import pytest

from tests.abuse import rawhttp
from tests.abuse.conftest import Target, gateway_to
from tests.gateway.conftest import MODEL
from tests.procs import start_runtime

HEAD_S, HEAD_TOTAL_S, BODY_S, KEEP_ALIVE_S = 1, 3, 2, 2
FLAGS = ("--head-timeout-seconds", str(HEAD_S), "--head-total-seconds", str(HEAD_TOTAL_S),
         "--body-timeout-seconds", str(BODY_S), "--keep-alive-seconds", str(KEEP_ALIVE_S), "--min-body-rate", "1")
GRACE_S = 1.0  # how late after its timeout a cut may come (each case waits a second longer, then fails)
STEP_S = 0.5  # a client that keeps moving sends something this often
CUT = ([], [408])  # what a cut connection may have said before closing: nothing, or 408


@pytest.fixture(scope="module")
def runtime():
    srv = start_runtime(*FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gateway(server):
    """In front of the shared default runtime: the timeouts under test are the gateway's alone."""
    srv = gateway_to(server, *FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["runtime", "gateway"])
def target(request) -> Target:
    return Target(request.param, request.getfixturevalue(request.param))


def test_a_slowloris_head_is_cut_at_head_total(target: Target) -> None:
    """One byte every 0.5 s, forever: each gap is under --head-timeout-seconds, the whole is not."""
    head = b"GET /health HTTP/1.1\r\nHost: abuse\r\nX-Slow: " + b"a" * 1000
    sock = rawhttp.connect(target.port)
    start = time.monotonic()
    out, sent = rawhttp.Drained(b"", False, 0.0), 0
    while time.monotonic() - start < HEAD_TOTAL_S + GRACE_S + 1:
        try:
            sock.sendall(head[sent:sent + 1])
        except OSError:
            out = rawhttp.Drained(b"", True, 0.0)
            break
        sent += 1
        out = rawhttp.drain(sock, STEP_S) if rawhttp.readable(sock, STEP_S) else out
        if out.data or out.closed:
            break
    ended = time.monotonic() - start
    sock.close()
    print(f"{target.kind}: {sent} head bytes sent; ended after {ended:.2f}s (closed {out.closed}), "
          f"statuses {out.statuses}")
    assert out.closed, f"a {ended:.1f}s slowloris head is still open (--head-total-seconds {HEAD_TOTAL_S})"
    assert ended <= HEAD_TOTAL_S + GRACE_S, f"cut after {ended:.2f}s, not at {HEAD_TOTAL_S}s"
    assert out.statuses in CUT, f"answered {out.statuses}: {out.data[:300]!r}"
    target.still_serving()


def test_a_head_that_stalls_is_cut_at_head_timeout(target: Target) -> None:
    sock = rawhttp.connect(target.port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: abuse\r\n")
    out = rawhttp.drain(sock, HEAD_S + GRACE_S + 1)
    sock.close()
    print(f"{target.kind}: closed {out.closed} {out.seconds:.2f}s after the head stalled, statuses {out.statuses}")
    assert out.closed and out.seconds <= HEAD_S + GRACE_S, \
        f"a stalled head still open after {out.seconds:.2f}s (--head-timeout-seconds {HEAD_S})"
    assert out.statuses in CUT, f"answered {out.statuses}: {out.data[:300]!r}"
    target.still_serving()


def test_a_head_that_keeps_moving_within_head_total_is_answered(target: Target) -> None:
    """Five pieces 0.5 s apart, 2 s in all: longer than --head-timeout-seconds, shorter than the total.
    The gaps are measured: an attempt in which this process (on a loaded machine) let a gap reach the
    head timeout, or the whole the total, proves nothing either way and is made again."""
    head = rawhttp.request("GET", "/health")
    step = -(-len(head) // 5)
    for _attempt in range(3):
        sock = rawhttp.connect(target.port)
        sent_at: list[float] = []
        for i in range(0, len(head), step):
            if i:
                time.sleep(STEP_S)
            sock.sendall(head[i:i + step])
            sent_at.append(time.monotonic())
        answer = rawhttp.read_answer(sock, 10)
        sock.close()
        gaps = [b - a for a, b in pairwise(sent_at)]
        if max(gaps) < HEAD_S - 0.1 and sent_at[-1] - sent_at[0] < HEAD_TOTAL_S - 0.1:
            break
    else:
        pytest.fail(f"three attempts each sent with a gap near {HEAD_S}s: this machine cannot judge it")
    assert answer.status == 200, f"answered {answer.status}: {answer.body[:300]!r}"
    target.still_serving()


def test_an_idle_keep_alive_connection_is_closed_after_keep_alive(target: Target) -> None:
    sock = rawhttp.connect(target.port)
    sock.sendall(rawhttp.request("GET", "/health"))
    assert rawhttp.read_answer(sock, 10).status == 200
    out = rawhttp.drain(sock, KEEP_ALIVE_S + GRACE_S + 1)
    sock.close()
    print(f"{target.kind}: closed {out.closed} {out.seconds:.2f}s after its answer, statuses {out.statuses}")
    assert out.closed and out.seconds <= KEEP_ALIVE_S + GRACE_S, \
        f"an idle connection still open after {out.seconds:.2f}s (--keep-alive-seconds {KEEP_ALIVE_S})"
    assert out.statuses in CUT, f"said {out.statuses}: {out.data[:300]!r}"
    target.still_serving()


def test_a_connection_that_never_sends_is_closed(target: Target) -> None:
    """No byte at all: cut by the keep-alive or the head timeouts, whichever the server applies first."""
    bound = max(KEEP_ALIVE_S, HEAD_TOTAL_S) + GRACE_S
    sock = rawhttp.connect(target.port)
    out = rawhttp.drain(sock, bound + 1)
    sock.close()
    print(f"{target.kind}: a silent connection closed {out.closed} after {out.seconds:.2f}s")
    assert out.closed and out.seconds <= bound, f"a silent connection still open after {out.seconds:.2f}s"
    assert out.statuses in CUT, f"said {out.statuses}: {out.data[:300]!r}"
    target.still_serving()


def test_a_body_that_stalls_is_cut_at_body_timeout(target: Target) -> None:
    sock = rawhttp.connect(target.port)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: abuse\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n" + b'{"input": "' + b"a" * 89)
    out = rawhttp.drain(sock, BODY_S + GRACE_S + 1)
    sock.close()
    print(f"{target.kind}: closed {out.closed} {out.seconds:.2f}s after the body stalled, statuses {out.statuses}")
    assert out.closed and out.seconds <= BODY_S + GRACE_S, \
        f"a stalled body still open after {out.seconds:.2f}s (--body-timeout-seconds {BODY_S})"
    assert out.statuses in CUT, f"answered {out.statuses}: {out.data[:300]!r}"
    target.still_serving()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_upload_that_keeps_moving_is_answered_whatever_it_takes(target: Target, framing: str) -> None:
    """A piece every 0.5 s for 6 s: longer than every timeout, and never cut."""
    body = json.dumps({"model": MODEL, "input": ["a slow upload, still moving"]}).encode()
    pieces = [body[i:i + 5] for i in range(0, len(body), 5)]
    while len(pieces) < 13:  # JSON allows trailing white space: 13 pieces, 6 s
        pieces.append(b" ")
    headers = {"Content-Type": "application/json"}
    if framing == "chunked":
        headers["Transfer-Encoding"] = "chunked"
    else:
        headers["Content-Length"] = str(len(b"".join(pieces)))
    sock = rawhttp.connect(target.port)
    start = time.monotonic()
    sock.sendall(rawhttp.request("POST", "/v1/embeddings", headers))
    for i, piece in enumerate(pieces):
        time.sleep(STEP_S)
        data = rawhttp.chunk(piece) if framing == "chunked" else piece
        if framing == "chunked" and i == len(pieces) - 1:
            data += b"0\r\n\r\n"
        assert not rawhttp.readable(sock), \
            f"the server spoke or closed {time.monotonic() - start:.1f}s into an upload that keeps moving: " \
            f"{rawhttp.recv_some(sock, 0)!r}"
        sock.sendall(data)
    answer = rawhttp.read_answer(sock, 60)
    took = time.monotonic() - start
    sock.close()
    print(f"{target.kind} {framing}: answered {answer.status} after {took:.1f}s of upload")
    assert answer.status == 200, f"answered {answer.status}: {answer.body[:300]!r}"
    vectors = json.loads(answer.body)["data"]
    assert len(vectors) == 1 and len(vectors[0]["embedding"]) > 0
    target.still_serving()


def test_a_keep_alive_connection_used_every_second_stays_open(target: Target) -> None:
    """A request a second for 5 s on one connection: each gap is under --keep-alive-seconds."""
    sock = rawhttp.connect(target.port)
    buffered = bytearray()
    for i in range(6):
        if i:
            time.sleep(1.0)
        sock.sendall(rawhttp.request("GET", "/health"))
        answer = rawhttp.read_answer(sock, 10, buffered)
        assert answer.status == 200, f"request {i} answered {answer.status}"
        assert not answer.closes, f"request {i}'s answer closes the connection"
    sock.close()
    target.still_serving()
