"""Real processes for the async tests: redis-server, `embedfleet worker`, a webhook receiver."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import redis

from embedfleet.runtime.asyncq.keys import Keys
from embedfleet.runtime.settings import DEFAULT_MODEL_NAME
from tests.procs import ROOT, child_env, free_port, spawn, stop_process

# the keys of a runtime or worker started without --model / --redis-prefix: its deployment is the default model
KEYS = Keys.for_deployment([DEFAULT_MODEL_NAME])


@dataclass
class RedisServer:
    """redis-server on loopback, a random port and its own directory; AOF when asked."""

    port: int
    dir: Path
    appendonly: bool
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def start(self) -> None:
        cmd = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
               "--dir", str(self.dir), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
               "--logfile", str(self.dir / "redis.log")]
        self.proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server did not start: {(self.dir / 'redis.log').read_text()[-2000:]}")

    def stop(self) -> None:
        """Graceful: SIGTERM makes redis fsync its AOF before exiting, as a pod stop would."""
        if self.proc:
            stop_process(self.proc, signal.SIGTERM)

    def restart(self) -> None:
        self.stop()
        self.start()


def start_redis(appendonly: bool = False) -> RedisServer:
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed: run scripts/setup.sh --test")
    server = RedisServer(free_port(), Path(tempfile.mkdtemp(prefix="embedfleet-redis-")), appendonly)
    server.start()
    return server


@dataclass
class WorkerProcess:
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_consuming(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "consuming jobs" in self.log():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"worker did not start:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        stop_process(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM)


def start_worker(redis_url: str, *flags: str) -> WorkerProcess:
    log_file = tempfile.NamedTemporaryFile(prefix="embedfleet-worker-", suffix=".log", delete=False)
    proc = spawn(
        [sys.executable, "-m", "embedfleet.runtime.cli", "worker", "--redis-url", redis_url, *flags],
        stdout=log_file, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    return WorkerProcess(proc, Path(log_file.name))


def jobs_cli(redis_url: str, *args: str, deployment: str | None = DEFAULT_MODEL_NAME) -> subprocess.CompletedProcess:
    named = ["--deployment", deployment] if deployment else []
    return subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "jobs", "--redis-url", redis_url, *named,
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env=child_env({"EMBEDFLEET_SERVED_MODEL_NAME": None, "EMBEDFLEET_REDIS_PREFIX": None}))


@dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class WebhookReceiver:
    """A real HTTP server on 127.0.0.1; `respond(path, nth_delivery_to_path)` picks the status code."""

    respond: Callable[[str, int], int]
    deliveries: list[Delivery] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def to(self, path: str) -> list[Delivery]:
        return [d for d in self.deliveries if d.path == path]

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                receiver.deliveries.append(Delivery(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver.respond(self.path, len(receiver.to(self.path)))
                payload = json.dumps({"ok": status < 300}).encode()
                self.send_response(status)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
