"""`serve --standby`: a parent that has done the slow part of a start once, and replaces a server that dies.

Most of a start on a CPU is not the model: the interpreter, torch's import (about a second on two cores)
and the web stack come before the first weight is read. The standby parent imports all of that, binds the
listening socket, and forks the server; the server loads the model and serves on the inherited socket.
When the server dies of a signal (a segfault in a native library, `kill -9`, an OOM kill that takes the
server alone: on cgroup v2 the kubelet makes an OOM kill take the whole container), the parent
forks another at once: the new server starts from the imported state, so it answers within the model's
own load and warm-up, and the socket never closed, so connections made meanwhile wait in its queue
instead of being refused. The kubelet sees no restart; /ready answers 503 while the new server loads, and
the pod stays Ready unless that takes longer than the readiness probe's failure window.

What it does not change: the first start (the parent's imports are the same imports), and a crash of the
parent itself (the container restarts, as without it). A server that exits by itself (status 1: its model
failed to load; 2: a bad setting) ends the parent with the same status, as does a server that keeps dying
(more than MAX_RESTARTS in RESTART_WINDOW_S). SIGTERM and SIGINT are passed to the server, whose drain is
unchanged; the parent exits with its status.

Costs (docs/runtime.md, Standby): the parent's memory, shared copy-on-write with the server until either
writes it (`gc.freeze` keeps the collector from touching the imported objects); no new port, socket or
right: the parent is the same user in the same container, and only ever waits for its child.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable

from embedfleet.runtime.cold_start import STARTED_ENV as STARTED
from embedfleet.runtime.cold_start import process_age_s
from embedfleet.runtime.settings import RuntimeSettings
from embedfleet.runtime.split.supervisor import PR_SET_PDEATHSIG, listen
from embedfleet.runtime.startgc import hold, release

log = logging.getLogger("embedfleet.serve")
#: What the server imports on its way to serving the torch engine: imported once, in the parent.
PREIMPORT = ("numpy", "torch", "tokenizers", "safetensors.torch", "uvloop",
             "embedfleet.runtime.engines.torch_engine", "embedfleet.runtime.engines.bert_native",
             "embedfleet.runtime.service", "embedfleet.runtime.metrics", "embedfleet.runtime.api.app",
             "embedfleet.runtime.api.gate", "embedfleet.runtime.lifespan", "embedfleet.runtime.tracing",
             "embedfleet.httpserver", "embedfleet.otel")
MAX_RESTARTS = 5  # servers that died of a signal within RESTART_WINDOW_S before the parent gives up
RESTART_WINDOW_S = 600.0


def preimport(names: tuple[str, ...] = PREIMPORT) -> list[str]:
    """Import `names`; returns those that could not be (an optional part missing from this install)."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


SIGNALS = {signal.SIGTERM, signal.SIGINT}


class Standby:
    """The parent: forks servers, passes signals on, and decides after each death whether to go on."""

    def __init__(self, serve: Callable[[socket.socket], int], sock: socket.socket,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.serve = serve
        self.sock = sock
        self.clock = clock
        self.child = 0
        self.stopping = 0  # the signal being passed on (SIGTERM or SIGINT), once one came
        self.deaths: deque[float] = deque()
        self.generation = 0
        self.pid = os.getpid()
        self.started = time.time() - (process_age_s() or 0.0)  # the first server's cold start counts from here

    def _signal(self, signum: int, _frame) -> None:
        self.stopping = self.stopping or signum
        if self.child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signum)
        # the server closes its copy of the socket when it stops; with ours closed too, new connections are
        # refused from then on instead of waiting in the queue for a server that will not take them
        with contextlib.suppress(OSError):
            self.sock.close()

    def _fork(self) -> int:
        """Fork a server. SIGTERM and SIGINT are blocked across the fork, so one that comes meanwhile is
        neither handled by the child's copy of the parent's handler nor lost: the parent handles it once it
        knows the child (and passes it on), the child once its own default handling is in place."""
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        pid = os.fork()
        if pid:
            self.child = pid
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
            return pid
        code = 1
        try:
            try:  # the server: default signal handling (it installs its own), and it dies with the parent
                for signum in SIGNALS:
                    signal.signal(signum, signal.SIG_DFL)
                with contextlib.suppress(OSError, AttributeError):
                    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != self.pid:  # the parent died before the line above: no one to serve for
                    return 1
                if self.generation == 0:  # the first server's start includes the parent's imports
                    os.environ[STARTED] = repr(self.started)
                else:
                    os.environ.pop(STARTED, None)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
                hold()  # the server's own start collects rarely too; its lifespan releases (startgc.py)
                code = self.serve(self.sock)
            except BaseException:  # whatever happened, the child must not return into the parent's loop
                log.exception("the server failed")
            try:
                signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:  # exiting regardless
                pass
        finally:
            os._exit(code)

    def gives_up(self, now: float) -> bool:
        """Record a death at `now`; True when more than MAX_RESTARTS fell within RESTART_WINDOW_S."""
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - RESTART_WINDOW_S:
            self.deaths.popleft()
        return len(self.deaths) > MAX_RESTARTS

    def _wait(self, child: int) -> int:
        """The child's wait status. As a container's first process the parent also inherits whatever the
        server started and left behind when it died: those are reaped here too, and otherwise ignored."""
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                return status

    def run(self) -> int:
        for signum in SIGNALS:
            signal.signal(signum, self._signal)
        while not self.stopping:
            child = self._fork()
            if self.stopping:  # a signal came before the child was known: the new server is told too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, self.stopping)
            status = self._wait(child)
            self.child = 0
            if os.WIFEXITED(status):  # the server ended by itself: drained (0), or could not serve (1, 2)
                return os.WEXITSTATUS(status)
            died = os.WTERMSIG(status)
            if self.stopping:
                return 128 + died
            name = signal.Signals(died).name if died in signal.Signals._value2member_map_ else str(died)
            if self.gives_up(self.clock()):
                log.error("the server (pid %d) died of %s, the %dth time in %.0fs: giving up", child, name,
                          len(self.deaths), RESTART_WINDOW_S)
                return 1
            self.generation += 1
            log.warning("the server (pid %d) died of %s; starting another from the standby parent "
                        "(%d in the last %.0fs)", child, name, len(self.deaths), RESTART_WINDOW_S)
        return 128 + self.stopping


def run(settings: RuntimeSettings, serve: Callable[[socket.socket], int]) -> int:
    """Import, listen, then serve in forked children until one ends by itself or a signal stops us."""
    started = time.perf_counter()
    missing = preimport()
    sock = listen(settings.host, settings.port, backlog=2048, inheritable=False)
    log.info("standby: imported in %.2fs%s; listening on http://%s:%d; the server runs in a child process, "
             "replaced from here if it dies", time.perf_counter() - started,
             f" (not installed: {', '.join(missing)})" if missing else "", settings.host, sock.getsockname()[1])
    gc.freeze()  # the imported objects stay out of the collector's passes: fewer pages copied into each child
    release()  # a parent that lives as long as the pod collects its own garbage (startgc.py)
    try:
        return Standby(serve, sock).run()
    finally:
        sock.close()
