"""Real processes for tests: the runtime server, started exactly as a user would start it.

Every child a test starts goes through `spawn`: its own session (so stopping it can take its whole
process group, and a Ctrl-C at the terminal reaches pytest, which stops it in teardown) and, on
Linux, PR_SET_PDEATHSIG so the kernel kills it when pytest dies, even by SIGKILL or SIGILL, when no
teardown runs (the kernel watches the thread that started the child: start them from the main
thread, as fixtures do). An atexit handler kills what is left on an ordinary exit, on any platform.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SOURCE_PATHS = [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT / "client"), str(ROOT / "gateway")]
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_SPAWNED: list[subprocess.Popen] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """This environment, the checkout on PYTHONPATH, offline; `extra` on top (None removes a name)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*SOURCE_PATHS, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _die_with(parent: int, nice: int = 0):
    def preexec() -> None:  # in the child, between fork and exec: no locks, no imports
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        if nice:
            try:  # a higher priority needs root (CAP_SYS_NICE); without it the child runs at ours
                os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)
            except OSError:
                pass
    return preexec


def spawn(cmd: list[str], nice: int = 0, **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen in its own session, killed with pytest (see the module docstring); `nice` is added
    to the child's niceness (negative: a higher CPU priority, where this process may grant it)."""
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with(os.getpid(), nice), **popen_kwargs)
    _SPAWNED[:] = [p for p in _SPAWNED if p.poll() is None]
    _SPAWNED.append(proc)
    return proc


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Ask with `sig`, wait up to `timeout`, then SIGKILL; then kill whatever of its group is left."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # grandchildren; the group outlives its leader
    except (ProcessLookupError, PermissionError):
        pass
    if proc in _SPAWNED:
        _SPAWNED.remove(proc)


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_SPAWNED):
        stop_process(proc, signal.SIGKILL, timeout=5)


@dataclass
class RuntimeServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    headers: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # where it listens: loopback, or an address of a network namespace or pod IP

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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
        def exited() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")

        if not wait_url_ready(self.url, timeout, exited):
            raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def wait_probed(self, timeout: float = 120) -> None:
        """Wait for each model's start-up probe, which runs a second after the models serve, on the engine
        thread: tests then time and count engine work from a settled start. GET /load says per model
        (`probe`: pending, done or failed); an open path, counted nowhere, where a pending GET .../probe
        would be a 503 in the error counters the tests read."""
        deadline = time.monotonic() + timeout
        while True:
            models = httpx.get(f"{self.url}/load", timeout=10).json().get("models") or {}
            pending = [name for name, m in models.items() if m.get("probe") == "pending"]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert models and all(m.get("probe") == "done" for m in models.values()), f"the start-up probes: {models}"

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGINT)


def wait_url_ready(url: str, timeout: float = 120, check: Callable[[], None] | None = None) -> bool:
    """Poll ``url/ready`` until it answers 200 (True) or ``timeout`` passes (False); ``check`` runs
    between polls and may raise (a server process that died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def start_runtime(*flags: str, env: dict[str, str | None] | None = None, wait_ready: bool = True) -> RuntimeServer:
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="embedfleet-serve-", suffix=".log", delete=False)
    proc = spawn(
        [sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         *flags],
        stdout=log_file, stderr=subprocess.STDOUT, env=child_env(env), cwd=ROOT,
    )
    srv = RuntimeServer(proc, port, Path(log_file.name))
    if wait_ready:
        srv.wait_ready()
        srv.wait_probed()
    return srv
