"""The one thread that ever touches a model, with a hand-off lighter than a thread pool's.

Torch's OpenMP pools belong to the thread that calls them, and a model touched from several threads ran
single queries 2x slower here, so each model is loaded, warmed up and run on one thread for the
process' life (service.py). A `ThreadPoolExecutor(1)` did that, at a price on the single-query path:
each batch handed over built a Future with its condition variable and took the pool's idle semaphore;
and once the batch was done, the thread set that Future and released the semaphore (condition
variables in Python, tens of microseconds on a cold two-core VM) while holding the GIL the event loop
had just been woken to deliver the answer with.

`post` hands a call over with one put on a C queue and no Future; once it returns the thread waits
for the next one at once. `submit` is the Executor interface (`loop.run_in_executor`: loading, warm-up,
probes, calibration), with a Future, for the calls that are not on the request path.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from functools import partial
from typing import Any

log = logging.getLogger(__name__)


PR_SET_NAME = 15
_libc: ctypes.CDLL | None = None


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) where the OS shows it: /proc/<pid>/task/<tid>/comm,
    `top -H`, `ps -L`, py-spy. Python names its threads for itself alone, so every thread of the server read
    "python" there, and a thread's CPU could not be told from another's. Best effort: elsewhere than Linux, or
    if the call fails, nothing changes."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode("ascii", "replace")[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        pass


class EngineThread(Executor):
    """A single thread running the calls handed to it in order."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future | None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_os_thread("engine")
        get = self._calls.get
        while (call := get()) is not None:
            fn, args, future = call
            if future is None:
                try:
                    fn(*args)
                except BaseException:  # a posted call answers its own errors; one that did not must not end the thread
                    log.exception("uncaught error in a call on the engine thread")
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the thread, after what was handed over before; nothing to wait on, so `fn`
        reports its result itself (the batch manager's `_compute` calls back into the event loop)."""
        if self._closed:
            raise RuntimeError("the engine thread is shut down")
        self._calls.put((fn, args, None))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._calls.put((partial(fn, **kwargs) if kwargs else fn, args, future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Calls already handed over still run (`cancel_futures` is not supported: there is no backlog
        worth cancelling: the batch manager hands over at most one batch beyond the running one)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._calls.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()
