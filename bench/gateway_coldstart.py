"""Cold start through the gateway: how long after a replica is ready is a held request answered?

A gateway fronts a runtime port where nothing listens yet. A query is sent (the gateway holds it), then
`embedfleet serve` is started on that port. The replica's own start-up (process start, model load,
warm-up) is not the gateway's to shorten, so it is measured apart: a poller asks the runtime's
`/ready` directly every 5 ms, and the first 200 is "ready". The figure is the held request's answer
time minus that moment: what holding costs on top of the replica's start-up (the goal: <= 100 ms).
Repeated `--rounds` times (a fresh runtime each round; the gateway stays).

Prints one JSON line, also appended to bench/results/gateway-coldstart-cpu.jsonl: per-round (answer - ready)
in ms, their median and max, the replicas' start-up seconds, the gateway's `--held-poll-interval`, and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

from _common import ROOT, SOURCE_PATHS, add_results_dir, free_port, record, wait_ready
from embedfleet.gateway.config import GatewayConfig
from embedfleet.runtime.settings import DEFAULT_MODEL_NAME
from fastpath import cpu_name


def start(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(SOURCE_PATHS), HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "embedfleet.runtime.cli", *cmd], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def first_ready(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=1) as client:
        while not stop.is_set():
            try:
                if client.get(f"{url}/ready").status_code == 200:
                    out.append(time.monotonic())
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.005)


def one_round(gateway_url: str, runtime_port: int) -> tuple[float, float]:
    """(answer - ready, start-up) in seconds for one held request and one fresh runtime."""
    runtime_url = f"http://127.0.0.1:{runtime_port}"
    answer: list[float] = []

    def send() -> None:
        r = httpx.post(f"{gateway_url}/v1/embeddings", json={"model": DEFAULT_MODEL_NAME, "input": "held"},
                       timeout=300)
        r.raise_for_status()
        answer.append(time.monotonic())

    sender = threading.Thread(target=send)
    sender.start()
    while httpx.get(f"{gateway_url}/gateway/load").json()["deployments"][DEFAULT_MODEL_NAME]["held"] < 1:
        time.sleep(0.005)
    started = time.monotonic()
    proc = start(["serve", "--host", "127.0.0.1", "--port", str(runtime_port), "--log-level", "warning"])
    ready: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=first_ready, args=(runtime_url, stop, ready))
    poller.start()
    try:
        sender.join(300)
        poller.join(300)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return answer[0] - ready[0], ready[0] - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--held-poll-interval", type=float, default=GatewayConfig().held_poll_interval,
                   help="the gateway's flag (default: its default)")
    add_results_dir(p, "gateway-coldstart-cpu.jsonl")
    a = p.parse_args()
    runtime_port, gateway_port = free_port(), free_port()
    gateway = start(["gateway", "--host", "127.0.0.1", "--port", str(gateway_port), "--log-level", "warning",
                     "--upstream", f"{DEFAULT_MODEL_NAME}=http://127.0.0.1:{runtime_port}", "--hold-timeout", "300",
                     "--held-poll-interval", str(a.held_poll_interval)])
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    try:
        wait_ready(gateway_url, gateway, timeout=60)
        rounds = [one_round(gateway_url, runtime_port) for _ in range(a.rounds)]
    finally:
        gateway.terminate()
        gateway.wait(60)
    after = [r[0] * 1000 for r in rounds]
    row = {"figure": "gateway_coldstart", "rounds": a.rounds, "held_poll_interval_s": a.held_poll_interval,
           "answer_after_ready_ms": [round(x, 1) for x in after],
           "median_ms": round(statistics.median(after), 1), "max_ms": round(max(after), 1),
           "replica_startup_s": [round(r[1], 2) for r in rounds], "goal_ms": 100, "cpu": cpu_name()}
    print(json.dumps(row))
    record("gateway-coldstart", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
