"""Where a webhook may go, and how a delivery is bounded: only global unicast addresses, the checked
address is the one connected to (a DNS answer that changes cannot redirect it), the receiver's
answer is read only up to a cap and within one deadline, and an entry that keeps killing its senders
is dead-lettered. Deliveries go to real HTTP servers on loopback addresses, allowed there only by
`--webhook-allow-private` (loopback itself is refused by default, which is tested too)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.asyncq.delivery import MAX_TAKES, RESPONSE_CAP, WebhookSender
from embedfleet.runtime.asyncq.keys import WEBHOOK_GROUP, Keys
from embedfleet.runtime.asyncq.store import Entry, JobStore, connect
from embedfleet.runtime.asyncq.webhooks import WebhookRefused, is_public, resolve_webhook
from embedfleet.runtime.settings import RuntimeSettings

NOT_GLOBAL = ["0.0.0.0", "0.1.2.3", "10.1.2.3", "100.64.0.1", "100.100.100.200", "100.127.255.254", "127.0.0.1",
              "169.254.169.254", "172.16.5.5", "192.0.0.1", "192.0.0.170", "192.0.2.1", "192.168.0.9", "198.18.0.1",
              "198.19.255.254", "198.51.100.7", "203.0.113.9", "224.0.0.1", "233.252.0.1", "239.255.255.250",
              "240.0.0.1", "255.255.255.255",
              "::", "::1", "fe80::1", "fe80::1%1", "fc00::1", "fd12:3456::1", "fec0::1", "ff02::1", "ff0e::1",
              "100::1", "2001::1", "2001:db8::1", "::ffff:10.0.0.1", "::ffff:100.64.0.1", "::ffff:127.0.0.1",
              "::10.0.0.1", "64:ff9b::a00:1", "64:ff9b::7f00:1", "64:ff9b::6440:1", "64:ff9b:1::a00:1",
              "2002:a00:1::1", "2002:7f00:1::1", "2002:c612:1::1"]
GLOBAL = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e",
          "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"]

# ranges that `is_private` alone misses or that sit beside public space: every address in them is refused
REFUSED_RANGES = [ipaddress.ip_network(n) for n in (
    "100.64.0.0/10", "192.0.0.0/24", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4", "127.0.0.0/8", "10.0.0.0/8",
    "169.254.0.0/16", "fc00::/7", "fe80::/10", "ff00::/8", "::ffff:100.64.0.0/106", "64:ff9b::a00:0/104")]


@pytest.mark.parametrize("address", NOT_GLOBAL)
def test_non_global_addresses_are_refused(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize("address", GLOBAL)
def test_global_unicast_addresses_are_allowed(address: str) -> None:
    assert is_public(address)


@given(st.sampled_from(REFUSED_RANGES).flatmap(
    lambda net: st.integers(0, net.num_addresses - 1).map(lambda i: str(net[i]))))
def test_every_address_of_a_refused_range_is_refused(address: str) -> None:
    assert not is_public(address)


@given(st.one_of(st.integers(0, 2**32 - 1).map(lambda i: str(ipaddress.IPv4Address(i))),
                 st.integers(0, 2**128 - 1).map(lambda i: str(ipaddress.IPv6Address(i)))))
def test_never_more_permissive_than_is_global(address: str) -> None:
    ip = ipaddress.ip_address(address)
    if is_public(address):
        assert ip.is_global and not ip.is_multicast


def test_a_name_is_refused_when_any_of_its_addresses_is_internal() -> None:
    async def scenario() -> None:
        with pytest.raises(WebhookRefused, match="not a public"):
            await resolve_webhook("http://localhost:9/hook", allow_private=False)
        with pytest.raises(WebhookRefused, match=r"100\.64\.0\.1"):
            await resolve_webhook("http://100.64.0.1/hook", allow_private=False)
        target = await resolve_webhook("http://localhost:9/hook", allow_private=True)
        assert "127.0.0.1" in target.addresses and target.port == 9 and target.host == "localhost"

    asyncio.run(scenario())


# -- real receivers -----------------------------------------------------------------------------------
class Receiver:
    """An HTTP server on one loopback address; `answer(handler)` writes the response."""

    def __init__(self, address: str, port: int, answer: Callable[[BaseHTTPRequestHandler], None]) -> None:
        self.requests: list[dict[str, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver.requests.append({k.lower(): v for k, v in self.headers.items()})
                answer(self)

            def log_message(self, *args) -> None:
                return None

        self.server = ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def ok(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(204)
    handler.end_headers()


def endless(status: int, delay: float) -> Callable[[BaseHTTPRequestHandler], None]:
    """A body that never ends: 16 KiB chunks (delay 0), or one byte every `delay` seconds."""
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.end_headers()
        chunk = b"x" * (16384 if delay == 0 else 1)
        try:
            for _ in range(100_000):
                handler.wfile.write(chunk)
                handler.wfile.flush()
                if delay:
                    time.sleep(delay)
        except OSError:  # the sender hung up: expected
            pass
    return answer


def sender(store: JobStore | None = None, allow_private: bool = True, timeout: float = 5.0) -> WebhookSender:
    settings = RuntimeSettings(webhook_secret="whsec-test-only", webhook_allow_private=allow_private,
                               webhook_timeout=timeout)
    return WebhookSender(store, settings, "test-sender")  # type: ignore[arg-type]  (store unused by send)


def test_delivery_connects_to_the_checked_address_even_when_dns_changes() -> None:
    """DNS rebinding: the name resolves to 127.0.0.1 at the check and to 127.0.0.2 afterwards."""
    checked = Receiver("127.0.0.1", 0, ok)
    attacker = Receiver("127.0.0.2", checked.port, ok)  # same port, another address
    answers: list[str] = []

    async def scenario() -> str | None:
        loop = asyncio.get_running_loop()

        async def rebinding(host, port, *args, **kwargs):
            address = "127.0.0.1" if not answers else "127.0.0.2"
            answers.append(address)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]

        loop.getaddrinfo = rebinding  # type: ignore[method-assign]
        async with sender().client() as client:
            return await sender().send(client, f"http://hooks.rebind.test:{checked.port}/h", Entry("1-0", "job"),
                                       b"{}")

    try:
        assert asyncio.run(scenario()) is None
    finally:
        checked.stop()
        attacker.stop()
    assert answers == ["127.0.0.1"]  # resolved once, at the check
    assert len(checked.requests) == 1 and attacker.requests == []
    assert checked.requests[0]["host"] == f"hooks.rebind.test:{checked.port}"  # the receiver still sees its name


def test_loopback_receiver_is_refused_without_the_opt_in() -> None:
    receiver = Receiver("127.0.0.1", 0, ok)

    async def scenario() -> str | None:
        async with sender(allow_private=False).client() as client:
            return await sender(allow_private=False).send(client, f"http://127.0.0.1:{receiver.port}/h",
                                                          Entry("1-0", "job"), b"{}")

    try:
        error = asyncio.run(scenario())
    finally:
        receiver.stop()
    assert error is not None and "127.0.0.1" in error and "--webhook-allow-private" in error
    assert receiver.requests == []


def test_an_endless_error_body_is_read_only_up_to_the_cap() -> None:
    receiver = Receiver("127.0.0.1", 0, endless(500, 0))

    async def scenario() -> tuple[str | None, float]:
        started = time.monotonic()
        async with sender(timeout=20).client() as client:
            error = await sender(timeout=20).send(client, f"http://127.0.0.1:{receiver.port}/h",
                                                  Entry("1-0", "job"), b"{}")
        return error, time.monotonic() - started

    try:
        error, took = asyncio.run(scenario())
    finally:
        receiver.stop()
    assert error is not None and error.startswith("HTTP 500") and "xxxx" in error
    assert took < 5  # stopped after RESPONSE_CAP bytes, not at the 20 s timeout
    assert RESPONSE_CAP == 64 * 1024


def test_a_receiver_that_drips_bytes_is_cut_off_at_the_deadline() -> None:
    """Each byte arrives well within the read timeout; only the one deadline for the attempt ends it."""
    receiver = Receiver("127.0.0.1", 0, endless(200, 0.1))

    async def scenario() -> tuple[str | None, float]:
        started = time.monotonic()
        async with sender(timeout=1.5).client() as client:
            error = await sender(timeout=1.5).send(client, f"http://127.0.0.1:{receiver.port}/h",
                                                   Entry("1-0", "job"), b"{}")
        return error, time.monotonic() - started

    try:
        error, took = asyncio.run(scenario())
    finally:
        receiver.stop()
    assert error is not None and "--webhook-timeout" in error
    assert 1.4 < took < 4


def test_an_entry_handed_over_too_often_is_dead_lettered_without_a_delivery(redis_server) -> None:
    receiver = Receiver("127.0.0.1", 0, ok)
    keys = Keys.for_deployment(["webhook-target-test"])

    async def scenario() -> dict:
        store = JobStore(connect(redis_server.url), keys)
        await store.ensure_groups()
        job_id = await store.submit("embeddings", b"{}", f"http://127.0.0.1:{receiver.port}/h", max_depth=10)
        await store.redis.hset(keys.job(job_id), mapping={"status": "succeeded", "result": b"{}"})
        await store.redis.xadd(keys.webhooks, {"id": job_id, "attempt": 1})
        entry = (await store.read(keys.webhooks, WEBHOOK_GROUP, "first", 1, 100))[0]
        for name in ("second", "third"):  # two senders took it over and died too
            await store.reclaim(keys.webhooks, WEBHOOK_GROUP, name, 0, 10)
        taken = await store.times_taken(keys.webhooks, WEBHOOK_GROUP, [entry.entry_id])
        assert taken == {entry.entry_id: MAX_TAKES}
        within = Entry(entry.entry_id, job_id, 1, taken[entry.entry_id])
        async with sender(store).client() as client:
            assert await sender(store).send(client, f"http://127.0.0.1:{receiver.port}/h", within, b"{}") is None
            over = (await store.reclaim(keys.webhooks, WEBHOOK_GROUP, "fourth", 0, 10))[0]
            over.taken = (await store.times_taken(keys.webhooks, WEBHOOK_GROUP, [over.entry_id]))[over.entry_id]
            assert over.taken == MAX_TAKES + 1
            await sender(store).deliver(client, over)
        letters = await store.dead_letters()
        job = await store.job(job_id)
        await store.close()
        return {"letters": letters, "job": job}

    try:
        got = asyncio.run(scenario())
    finally:
        receiver.stop()
    assert len(receiver.requests) == 1  # the one delivery within the limit; none for the entry over it
    assert [f["attempts"] for _, f in got["letters"]] == ["1"] and "handed to a sender" in got["letters"][0][1]["error"]
    assert got["job"]["webhook_status"] == b"dead"
