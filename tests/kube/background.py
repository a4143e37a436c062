"""Threads that watch or drive a test cluster for the length of a `with` block (a stand-in kubelet, a
readiness relay, a sampler, a watch recorder): one place for starting them, stopping them and waiting for
them, so none outlives its test."""

from __future__ import annotations

import threading
from typing import Self


class Background:
    """Runs `run` in daemon threads between `__enter__` and `__exit__`; `run` returns soon after `stopping` is
    set (wait on it, not `time.sleep`). `threads` names the methods to run (one thread each)."""

    join_s = 10.0
    threads: tuple[str, ...] = ("run",)

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._threads = [threading.Thread(target=getattr(self, name), daemon=True) for name in self.threads]

    def run(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(self.join_s)


class Poller(Background):
    """Calls `poll` every `every_s` seconds until stopped (the first call after one interval when
    `wait_first`)."""

    every_s = 0.5
    wait_first = False

    def poll(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        if self.wait_first and self.stopping.wait(self.every_s):
            return
        while not self.stopping.is_set():
            self.poll()
            self.stopping.wait(self.every_s)
