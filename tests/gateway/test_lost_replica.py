"""A replica whose host goes silent mid-request (no reset, no FIN: a node lost or cut off) is found lost
within --upstream-dead-after, and the requests waiting on it go to another replica (also one whose bytes
it never acknowledged, once its poll fails); a replica that is only slow is never lost; a job submission
is never sent twice (docs/gateway.md, "Lost replicas").

The far replica is a stand-in runtime in a network namespace of its own, reached over a veth pair;
taking the namespace's end of the pair down cuts it off silently: the gateway's packets to it vanish.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import STUB, GatewayServer, StubRuntime, until, wait_for
from tests.procs import ROOT, RuntimeServer, child_env, free_port, spawn

MODEL = "stub-model"
DEAD_AFTER_S = 2  # the gateway's --upstream-dead-after in this test
SLOW_S = 2 * DEAD_AFTER_S + 1  # a live replica this slow must not be lost
# the promise: a request waiting on a silent replica is answered within dead-after seconds of the silence,
# plus up to a second for the keepalive timer (it counts from the last packet the replica answered, at
# most one probe interval before the cut), plus the retry to a replica that answers at once
ANSWERED_WITHIN_S = DEAD_AFTER_S + 1.0 + 0.5
# a request the replica never acknowledged: given up when the replica's poll fails (the gateway's defaults:
# --poll-interval 0.5, --poll-timeout 2), plus the retry
POLL_FAILS_WITHIN_S = 0.5 + 2.0 + 0.5

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="cutting a replica off silently needs root and `ip` (a network namespace)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class FarSide:
    """A network namespace reached from the host over one veth pair: host `near` <-> `far` inside
    (addresses of 198.18.0.0/15, routed only over the pair)."""

    name: str
    host_if: str
    inner_if: str
    near: str
    far: str

    def run(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def cut(self) -> None:
        """Packets to the far side vanish from now on: no reset, no ICMP, no FIN."""
        subprocess.run(self.run("ip", "link", "set", self.inner_if, "down"), check=True, capture_output=True)

    def mend(self) -> None:
        subprocess.run(self.run("ip", "link", "set", self.inner_if, "up"), check=True, capture_output=True)
        subprocess.run(self.run("ip", "route", "replace", f"{self.near}/32", "dev", self.inner_if), check=True,
                       capture_output=True)

    def delete(self) -> None:
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "del", self.name, check=False)


@pytest.fixture
def far_side() -> Iterator[FarSide]:
    tag = os.getpid() % 100000
    octet = os.getpid() % 250 + 1
    side = FarSide(f"ef-lost-{tag}", f"eflh{tag}", f"efli{tag}", f"198.19.238.{octet}", f"198.19.239.{octet}")
    side.delete()
    try:
        _ip("netns", "add", side.name)
        _ip("link", "add", side.host_if, "type", "veth", "peer", "name", side.inner_if)
        _ip("link", "set", side.inner_if, "netns", side.name)
        _ip("addr", "add", f"{side.near}/32", "dev", side.host_if)
        _ip("link", "set", side.host_if, "up")
        _ip("route", "add", f"{side.far}/32", "dev", side.host_if)
        subprocess.run(side.run("ip", "addr", "add", f"{side.far}/32", "dev", side.inner_if), check=True,
                       capture_output=True)
        side.mend()
        yield side
    finally:
        side.delete()


def _start(prefix: str, argv: list[str], server: type[RuntimeServer], **fields) -> RuntimeServer:
    log_file = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)
    proc = spawn(argv, stdout=log_file, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    srv = server(proc, fields.pop("port"), Path(log_file.name), **fields)
    srv.wait_ready(timeout=60)
    return srv


def test_a_silent_replica_is_lost_and_its_requests_answered_elsewhere(far_side):
    port = free_port()
    far = _start("embedfleet-stub-far-", far_side.run(sys.executable, str(STUB), "--host", far_side.far, "--port",
                                                      str(port), "--name", "far", "--delay", str(SLOW_S)),
                 StubRuntime, port=port, host=far_side.far)
    port = free_port()
    near = _start("embedfleet-stub-near-", [sys.executable, str(STUB), "--name", "near", "--port", str(port)],
                  StubRuntime, port=port)
    near.control(status="saturated")  # routable, but only when the far one cannot take work
    gport = free_port()
    gateway = _start("embedfleet-gateway-", [
        sys.executable, "-m", "embedfleet.runtime.cli", "gateway", "--host", "127.0.0.1", "--port", str(gport),
        "--upstream", f"{MODEL}={far.url}", "--upstream", f"{MODEL}={near.url}",
        "--upstream-dead-after", str(DEAD_AFTER_S), "--max-queue-seconds", "0", "--max-queue-seconds-bulk", "0"],
        GatewayServer, port=gport)
    try:
        wait_for(lambda: gateway.load()[MODEL]["ready_replicas"] == 2, "both replicas polled")

        async def send(client: httpx.AsyncClient, tag: str, path: str = "/v1/embeddings"
                       ) -> tuple[float, httpx.Response]:
            r = await client.post(path, json={"model": MODEL, "input": "x", "tag": tag},
                                  headers={"x-request-timeout": "60"})
            return time.monotonic(), r

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=90) as client:
                # slow, not lost: answered by the far replica after SLOW_S, well past the dead-after time
                slow = await asyncio.gather(*(send(client, f"slow-{i}") for i in range(3)))
                assert [r.json()["served_by"] for _, r in slow] == ["far"] * 3
                assert gateway.count("embedfleet_gateway_retries_total", reason="lost") == 0

                # silent: four requests waiting on the far replica when it is cut off
                far.control(delay=120)
                tasks = [asyncio.create_task(send(client, f"cut-{i}")) for i in range(4)]
                await until(lambda: sum(e["tag"].startswith("cut-") for e in far.received()) == 4,
                            "four requests on the far replica")
                cut_at = time.monotonic()
                far_side.cut()
                answers = await asyncio.gather(*tasks)
                for done_at, r in answers:
                    assert r.status_code == 200, r.text
                    assert r.json()["served_by"] == "near"
                    assert done_at - cut_at <= ANSWERED_WITHIN_S, (done_at - cut_at, ANSWERED_WITHIN_S)
                assert gateway.count("embedfleet_gateway_retries_total", reason="lost") == 4
                assert gateway.load()[MODEL]["ready_replicas"] == 1  # the far one is down

                # a job submission waiting on a replica that goes silent is not sent twice
                far_side.mend()
                await until(lambda: gateway.load()[MODEL]["ready_replicas"] == 2, "the far replica back", 30)
                job = asyncio.create_task(send(client, "job", "/async/embeddings"))
                await until(lambda: any(e["tag"] == "job" for e in far.received()), "the job on the far replica")
                cut_at = time.monotonic()
                far_side.cut()
                done_at, r = await job
                assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_lost", r.text
                assert done_at - cut_at <= ANSWERED_WITHIN_S
                assert not any(e["tag"] == "job" for e in near.received())

                # a request sent on a kept-alive connection just after the cut is never acknowledged, so
                # keepalive does not probe it: the replica's failed poll gives that connection up
                far_side.mend()
                await until(lambda: gateway.load()[MODEL]["ready_replicas"] == 2, "the far replica back", 30)
                far.control(delay=0)
                for attempt in range(50):  # a poll begun while it was cut may still mark it down once
                    _, r = await send(client, f"warm-{attempt}")
                    if r.json()["served_by"] == "far":  # a kept-alive connection to it, idle now
                        break
                    await asyncio.sleep(0.1)
                assert r.json()["served_by"] == "far"
                resent = gateway.count("embedfleet_gateway_retries_total", reason="lost")
                far_side.cut()
                cut_at = time.monotonic()
                done_at, r = await send(client, "unacked")
                assert r.status_code == 200 and r.json()["served_by"] == "near", r.text
                assert gateway.count("embedfleet_gateway_retries_total", reason="lost") == resent + 1
                assert done_at - cut_at <= POLL_FAILS_WITHIN_S, (done_at - cut_at, POLL_FAILS_WITHIN_S)

        asyncio.run(scenario())
        assert gateway.proc.poll() is None
    finally:
        far.proc.kill()  # cut off with a request it sleeps on: a graceful stop would wait for that
        for srv in (gateway, near, far):
            srv.stop()
