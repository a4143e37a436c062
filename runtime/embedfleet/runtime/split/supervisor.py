"""The parent of a split server: holds the listening socket, starts the engines and the fronts, replaces a
front that dies, restarts an engine that is killed, and stops them in order on SIGTERM.

The listening socket is created here once and inherited by every front, so the kernel hands each new
connection to whichever front accepts first, and a front that dies loses only its own connections: the
queue of connections not yet accepted belongs to the socket, not to the front.

Stopping (SIGTERM): the fronts drain first (each turns /ready false, answers new work 503 and finishes
what it accepted, within --drain-timeout), then the engines stop (nothing is in them by then). SIGINT stops the
same way without waiting for the drain. A front that keeps dying (more than MAX_RESTARTS in a minute), an
engine that exits by itself (its models failed to load), or engines killed more than MAX_ENGINE_RESTARTS times
in ENGINE_WINDOW_S, stops the server with status 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

from embedfleet.runtime.settings import RuntimeSettings

log = logging.getLogger("embedfleet.serve")
ROLE = "_EMBEDFLEET_SPLIT_ROLE"  # engine | front (set by the supervisor for its children only)
RUN_DIR = "_EMBEDFLEET_SPLIT_DIR"  # the private directory of the sockets and the metrics files
LISTEN_FD = "_EMBEDFLEET_SPLIT_FD"  # a front's inherited listening socket
INDEX = "_EMBEDFLEET_SPLIT_INDEX"  # a front's or an engine's number (0, 1, ...)
MAX_RESTARTS = 10  # of fronts, per minute, before the server gives up
MAX_ENGINE_RESTARTS = 3  # of a killed engine (per engine), in ENGINE_WINDOW_S: a crash loop ends the server
ENGINE_WINDOW_S = 600.0
POLL_S = 0.25  # how soon a dead child is noticed (a poll costs the supervisor ~0.1 ms)
PR_SET_PDEATHSIG = 1


def link_path(run_dir: str, engine: int = 0) -> str:
    """Engine `engine`'s link socket (fronts send it token ids)."""
    return os.path.join(run_dir, f"engine-{engine}.link")


def http_path(run_dir: str, engine: int = 0) -> str:
    """Engine `engine`'s own application (engine 0's answers the routes fronts proxy)."""
    return os.path.join(run_dir, f"engine-{engine}.http")


def _die_with(parent: int):
    """A preexec_fn: in the child, before exec, so that a SIGKILLed supervisor leaves no orphans (and a
    supervisor that died between the fork and this call is noticed: the child then has another parent)."""
    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
    return arm


def listen(host: str, port: int, backlog: int, inheritable: bool = True) -> socket.socket:
    """The server's listening socket, shared by the processes that serve on it: inherited across exec by
    fronts (`inheritable`), or across fork only by standby's servers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=backlog)
    sock.set_inheritable(inheritable)
    return sock


@dataclass
class Supervisor:
    settings: RuntimeSettings
    argv: list[str]
    fronts: int
    run_dir: str = ""
    sock: socket.socket | None = None
    engine: dict[int, subprocess.Popen] = field(default_factory=dict)
    front: dict[int, subprocess.Popen] = field(default_factory=dict)
    restarts: deque = field(default_factory=deque)
    engine_restarts: deque = field(default_factory=deque)
    stopping: str = ""  # "", "drain" (SIGTERM) or "now" (SIGINT)

    def _env(self, role: str, index: int) -> dict[str, str]:
        env = {**os.environ, ROLE: role, RUN_DIR: self.run_dir, INDEX: str(index),
               "PROMETHEUS_MULTIPROC_DIR": os.path.join(self.run_dir, "metrics")}
        if role == "front":
            assert self.sock is not None
            env[LISTEN_FD] = str(self.sock.fileno())
            # a front tokenizes with its share of the cores; the engine keeps its own threads
            env.setdefault("RAYON_NUM_THREADS", str(max(1, self.settings.cores() // self.fronts)))
        return env

    def _spawn(self, role: str, index: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "embedfleet.runtime.serve", *self.argv]
        fds = (self.sock.fileno(),) if role == "front" and self.sock is not None else ()
        # its own session: a signal meant for the supervisor (a terminal's Ctrl-C, a group kill) is not also
        # delivered to the children behind its back; the supervisor passes each on in order
        child = subprocess.Popen(command, env=self._env(role, index), pass_fds=fds,
                                 preexec_fn=_die_with(os.getpid()), start_new_session=True)
        log.info("started the %s %d (pid %d)", role, index, child.pid)
        return child

    def _forget(self, pid: int) -> None:
        """A dead process's live gauges leave the sums (its counters stay: the work was done)."""
        from prometheus_client import multiprocess

        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(pid, os.path.join(self.run_dir, "metrics"))

    def run(self) -> int:
        self.run_dir = tempfile.mkdtemp(prefix="embedfleet-serve-")  # 0700: only this user reaches the sockets
        os.mkdir(os.path.join(self.run_dir, "metrics"))
        s = self.settings
        self.sock = listen(s.host, s.port, backlog=1024)
        log.info("listening on http://%s:%d with %d front processes and %d engine process%s", s.host,
                 self.sock.getsockname()[1], self.fronts, s.engines, "es" if s.engines > 1 else "")
        signal.signal(signal.SIGTERM, lambda *_: self._stop("drain"))
        signal.signal(signal.SIGINT, lambda *_: self._stop("now"))
        try:
            for index in range(self.settings.engines):
                self.engine[index] = self._spawn("engine", index)
            for index in range(self.fronts):
                if self.stopping:  # a signal came while they were starting: the rest are not started
                    break
                self.front[index] = self._spawn("front", index)
            return self._watch()
        finally:
            self._end()

    def _stop(self, how: str) -> None:
        if self.stopping == "now":
            return
        self.stopping = how
        self._signal_fronts()
        if self.sock is not None:  # new connections are refused at once, as a single process's would be,
            self.sock.close()      # instead of waiting in a backlog no front reads any more
            self.sock = None

    def _signal_fronts(self) -> None:
        for child in self.front.values():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM if self.stopping == "drain" else signal.SIGINT)

    def _watch(self) -> int:
        while True:
            if self.stopping:
                return self._wind_down()
            for index, child in list(self.engine.items()):
                code = child.poll()
                if code is None:
                    continue
                self._forget(child.pid)
                if code >= 0:  # it exited by itself: its models failed to load (it said why), or it was told to
                    log.error("engine %d exited with status %d; stopping", index, code)
                    return self._give_up()
                now = time.monotonic()
                self.engine_restarts.append(now)
                while self.engine_restarts and self.engine_restarts[0] < now - ENGINE_WINDOW_S:
                    self.engine_restarts.popleft()
                if len(self.engine_restarts) > MAX_ENGINE_RESTARTS * len(self.engine):
                    log.error("engine processes were killed %d times in %.0f s; stopping",
                              len(self.engine_restarts), ENGINE_WINDOW_S)
                    return self._give_up()
                log.error("engine %d was killed by signal %d; restarting it (meanwhile fronts send its share to "
                          "the other engines, or answer 503 if there are none)", index, -code)
                self.engine[index] = self._spawn("engine", index)
            for index, child in list(self.front.items()):
                code = child.poll()
                if code is None:
                    continue
                self._forget(child.pid)
                now = time.monotonic()
                self.restarts.append(now)
                while self.restarts and self.restarts[0] < now - 60:
                    self.restarts.popleft()
                if len(self.restarts) > MAX_RESTARTS:
                    log.error("front processes died %d times in a minute; stopping", len(self.restarts))
                    return self._give_up()
                log.warning("front %d (pid %d) ended with status %s; starting another", index, child.pid, code)
                self.front[index] = self._spawn("front", index)
            time.sleep(POLL_S)

    def _give_up(self) -> int:
        self._stop("now")
        self._wind_down()
        return 1

    def _wind_down(self) -> int:
        """Fronts first (they drain), then the engines."""
        limit = time.monotonic() + self.settings.drain_timeout + 5
        self._signal_fronts()  # again: a front started while the signal arrived had not had it
        for child in self.front.values():
            self._wait(child, limit)
        engines = [child for child in self.engine.values() if child.poll() is None]
        for child in engines:
            child.send_signal(signal.SIGTERM if self.stopping == "drain" else signal.SIGINT)
        limit = time.monotonic() + self.settings.drain_timeout + 5
        for child in engines:
            self._wait(child, limit)
        return 0

    @staticmethod
    def _wait(child: subprocess.Popen, until: float) -> None:
        try:
            child.wait(timeout=max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop in time; killing it", child.pid)
            child.kill()
            child.wait()

    def _end(self) -> None:
        for child in [*self.front.values(), *self.engine.values()]:
            if child.poll() is None:
                child.kill()
                child.wait()
        if self.sock is not None:
            self.sock.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def run(settings: RuntimeSettings, argv: list[str], fronts: int) -> int:
    return Supervisor(settings, argv, fronts).run()
