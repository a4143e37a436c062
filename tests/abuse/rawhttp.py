"""Raw-socket HTTP/1.1 for abuse tests: bytes exactly as a hostile client writes them, and what the server
does with them read back as plainly as possible (status lines, EOF, reset), plus readers of the server's
process (RSS, open descriptors) and a prober that times `GET /health` on other connections meanwhile.

Nothing here parses leniently on the server's behalf: an answer is its status line, its headers and a body
framed by Content-Length or chunked; whatever follows is counted as a second answer.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})")
MIB = 1024 * 1024


def connect(port: int, timeout: float = 10.0, sndbuf: int | None = None) -> socket.socket:
    """A TCP connection to 127.0.0.1:port; `sndbuf` bounds what the kernel holds for us unsent."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def reset(sock: socket.socket) -> None:
    """Close abruptly: SO_LINGER 0, so the kernel sends RST rather than FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def readable(sock: socket.socket, wait: float = 0.0) -> bool:
    return bool(select.select([sock], [], [], wait)[0])


def recv_some(sock: socket.socket, wait: float) -> bytes | None:
    """What is there within `wait` seconds: bytes, b"" at EOF or reset, None when nothing came."""
    if not readable(sock, wait):
        return None
    try:
        return sock.recv(65536)
    except (ConnectionResetError, BrokenPipeError):
        return b""


@dataclass
class Drained:
    """Everything a connection gave until it ended (or the wait ran out)."""

    data: bytes
    closed: bool  # EOF or reset seen
    seconds: float  # from the start of the wait to the end (or to giving up)

    @property
    def statuses(self) -> list[int]:
        return statuses(self.data)


def drain(sock: socket.socket, within: float) -> Drained:
    """Read until the server ends the connection or `within` seconds pass."""
    start = time.monotonic()
    chunks: list[bytes] = []
    while (left := within - (time.monotonic() - start)) > 0:
        got = recv_some(sock, left)
        if got is None:
            break
        if not got:
            return Drained(b"".join(chunks), True, time.monotonic() - start)
        chunks.append(got)
    return Drained(b"".join(chunks), False, time.monotonic() - start)


def statuses(data: bytes) -> list[int]:
    """The status of every answer in `data`, in order (bodies skipped by their framing)."""
    found: list[int] = []
    rest = data
    while rest:
        answer = parse_one(rest)
        if answer is None:
            match = STATUS_LINE.match(rest)
            if match:
                found.append(int(match.group(1)))
            break
        found.append(answer.status)
        rest = rest[answer.size:]
    return found


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    size: int  # bytes of the whole answer on the wire

    @property
    def closes(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


def parse_one(data: bytes) -> Answer | None:
    """The first whole answer in `data`, or None while it is incomplete (or not an answer)."""
    end = data.find(b"\r\n\r\n")
    match = STATUS_LINE.match(data)
    if end < 0 or not match:
        return None
    lines = data[:end].decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    pos = end + 4
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(data[pos:eol].split(b";")[0], 16)
            pos = eol + 2
            if size == 0:
                trailer_end = data.find(b"\r\n", pos)
                if trailer_end < 0:
                    return None
                return Answer(int(match.group(1)), headers, body, trailer_end + 2)
            if len(data) < pos + size + 2:
                return None
            body += data[pos:pos + size]
            pos += size + 2
    length = int(headers.get("content-length", "0"))
    if len(data) < pos + length:
        return None
    return Answer(int(match.group(1)), headers, data[pos:pos + length], pos + length)


def read_answer(sock: socket.socket, within: float = 30.0, buffered: bytearray | None = None) -> Answer:
    """One whole answer from a keep-alive connection; bytes after it stay in `buffered`."""
    buf = buffered if buffered is not None else bytearray()
    deadline = time.monotonic() + within
    while (answer := parse_one(bytes(buf))) is None:
        left = deadline - time.monotonic()
        got = recv_some(sock, max(left, 0))
        if got is None:
            raise TimeoutError(f"no whole answer within {within}s; got {bytes(buf[:300])!r}")
        if not got:
            raise ConnectionError(f"closed before a whole answer; got {bytes(buf[:300])!r}")
        buf += got
    del buf[:answer.size]
    return answer


def request(method: str, target: str, headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    """A well-formed request's bytes (Content-Length when there is a body)."""
    lines = [f"{method} {target} HTTP/1.1", "Host: abuse"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def get(port: int, target: str = "/health", timeout: float = 10.0) -> Answer:
    """One request on a fresh connection."""
    with connect(port, timeout) as sock:
        sock.sendall(request("GET", target, {"Connection": "close"}))
        return read_answer(sock, timeout)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


# -- the server's process


def server_pids(pid: int) -> list[int]:
    """The server's process and its children: a split server's (`--fronts`) engine and fronts are the
    supervisor's children, and what they hold is the server's."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid, *map(int, f.read().split())]
    except FileNotFoundError:
        return [pid]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def rss_bytes(pid: int) -> int:
    """Resident set size (VmRSS) of the server: the process and its children."""
    return sum(_rss(p) for p in server_pids(pid))


def fd_count(pid: int) -> int:
    """Descriptors the server has open: the process and its children."""
    return sum(len(os.listdir(f"/proc/{p}/fd")) for p in server_pids(pid))


class RssWatcher(threading.Thread):
    """Samples a process' RSS every `every` seconds until stopped: its baseline and its peak."""

    def __init__(self, pid: int, every: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.baseline = self.peak = rss_bytes(pid)
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.peak = max(self.peak, rss_bytes(self.pid))
            self._halt.wait(self.every)

    def stop(self) -> int:
        """Stop sampling; the peak growth over the baseline, in bytes."""
        self._halt.set()
        self.join()
        self.peak = max(self.peak, rss_bytes(self.pid))
        return self.peak - self.baseline

    def __enter__(self) -> RssWatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.is_alive():
            self.stop()


@dataclass
class Probe:
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)


class HealthProber(threading.Thread):
    """`GET /health` on a fresh connection every `every` seconds, each timed from connect to the end of
    its answer; a poll that fails or takes longer than `patience` is a failure (its latency: the time
    it was given)."""

    def __init__(self, port: int, every: float = 0.05, patience: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.port, self.every, self.patience = port, every, patience
        self.probe = Probe()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            start = time.monotonic()
            try:
                answer = get(self.port, "/health", self.patience)
                if answer.status != 200:
                    self.probe.failures.append(f"status {answer.status}")
            except (OSError, TimeoutError, ConnectionError) as exc:
                self.probe.failures.append(repr(exc))
            self.probe.latencies.append(time.monotonic() - start)
            self._halt.wait(self.every)

    def stop(self) -> Probe:
        self._halt.set()
        self.join()
        return self.probe

    def __enter__(self) -> HealthProber:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.is_alive():
            self.stop()
