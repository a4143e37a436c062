"""A real Prometheus server (/usr/bin/prometheus) for tests: scrape config in, HTTP API out."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.procs import free_port, spawn, stop_process

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


@dataclass
class PrometheusServer:
    proc: subprocess.Popen
    port: int
    dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>: the `data` of a success; AssertionError with Prometheus's error otherwise."""
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = reply.json()
        if body.get("status") != "success":
            raise AssertionError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)


def scrape_config(jobs: dict[str, list[tuple[str, dict[str, str]]]], rule_files: list[Path],
                  interval: str = "1s") -> dict[str, Any]:
    """One scrape job per name: [(host:port, target labels)]; target labels are what relabelling adds in a
    cluster (region, deployment; docs/observability.md)."""
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [target], "labels": labels} for target, labels in targets]}
            for job, targets in jobs.items()
        ],
    }


def start_prometheus(config: dict[str, Any], timeout: float = 60) -> PrometheusServer:
    folder = Path(tempfile.mkdtemp(prefix="embedfleet-prometheus-"))
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    proc = spawn([PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
                  f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    server = PrometheusServer(proc, port, folder)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise TimeoutError(f"prometheus not ready after {timeout}s:\n{server.log()[-3000:]}")
