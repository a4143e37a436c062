"""Real processes for tests: the runtime server, started exactly as a user would start it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SOURCE_PATHS = [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT / "client")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*SOURCE_PATHS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(extra or {})
    return env


@dataclass
class RuntimeServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, headers=self.headers, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples (those matching `labels`) from the live /metrics page."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total, seen = 0.0, False
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total, seen = total + sample.value, True
        if not seen:
            raise KeyError(f"{name} not exported")
        return total

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_runtime(*flags: str, env: dict[str, str] | None = None, wait_ready: bool = True) -> RuntimeServer:
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="embedfleet-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         *flags],
        stdout=log_file, stderr=subprocess.STDOUT, env=child_env(env), cwd=ROOT,
    )
    srv = RuntimeServer(proc, port, Path(log_file.name))
    if wait_ready:
        srv.wait_ready()
    return srv
