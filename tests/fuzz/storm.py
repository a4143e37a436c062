"""A load storm on a live server: many raw HTTP/1.1 clients at once, some of which hang up midway.

Each client keeps one connection and sends POST /v1/embeddings with 1, 8 or 32 inputs, back to back.
One request in eight is abandoned: the client closes its connection either halfway through sending the
body or after sending it, before the answer (a client that gave up while its inputs were queued or in
the engine). The mix comes from a seeded random.Random; timing, of course, does not.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson

WORDS = ("embedding fleet token batch queue vector model server client socket storm cancel latency cosine "
         "passage query document rerank sparse dense pool").split()


@dataclass
class StormReport:
    seconds: float
    statuses: dict[int, int] = field(default_factory=dict)
    abandoned: int = 0
    transport_errors: int = 0
    server_errors: list[str] = field(default_factory=list)  # the first few 5xx: request and answer

    def __str__(self) -> str:
        return (f"storm of {self.seconds:.0f}s: statuses {dict(sorted(self.statuses.items()))}, "
                f"{self.abandoned} abandoned, {self.transport_errors} transport errors"
                + "".join(f"\n  {e}" for e in self.server_errors))


def _body(rng: random.Random) -> bytes:
    size = rng.choice((1, 1, 8, 32))
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 60))) for _ in range(size)]
    return orjson.dumps({"input": texts[0] if size == 1 and rng.random() < 0.5 else texts})


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def _client(host: str, port: int, rng: random.Random, until: float, report: StormReport) -> None:
    writer = None
    while time.monotonic() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            body = _body(rng)
            head = (f"POST /v1/embeddings HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n\r\n").encode()
            abandon = rng.random() < 1 / 8
            if abandon and rng.random() < 0.5:  # hang up halfway through the body
                writer.write(head + body[: len(body) // 2])
                await writer.drain()
                await asyncio.sleep(rng.random() * 0.05)
            else:
                writer.write(head + body)
                await writer.drain()
                if abandon:  # hang up while it is queued or in the engine
                    await asyncio.sleep(rng.random() * 0.2)
            if abandon:
                writer.transport.abort()
                writer, report.abandoned = None, report.abandoned + 1
                continue
            status, answer = await _read_response(reader)
            report.statuses[status] = report.statuses.get(status, 0) + 1
            if status >= 500 and len(report.server_errors) < 5:
                report.server_errors.append(f"{status} {answer[:300]!r} for a body of {len(body)} bytes")
            if status == 429:
                await asyncio.sleep(0.05)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            report.transport_errors += 1
            if writer is not None:
                writer.transport.abort()
            writer = None
            await asyncio.sleep(0.05)
    if writer is not None:
        writer.close()


async def _storm(url: str, clients: int, seconds: float, seed: int) -> StormReport:
    parts = urlsplit(url)
    report = StormReport(seconds)
    until = time.monotonic() + seconds
    rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
    await asyncio.gather(*(_client(parts.hostname, parts.port, rng, until, report) for rng in rngs))
    return report


def storm(url: str, clients: int = 96, seconds: float = 20, seed: int = 0) -> StormReport:
    """`clients` concurrent clients for `seconds` against `url`; returns once every client has stopped."""
    return asyncio.run(_storm(url, clients, seconds, seed))
