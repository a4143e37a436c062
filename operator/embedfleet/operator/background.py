"""A worker that lives as long as the operator: the hub's scheduling loop, the spoke's heartbeat.

Its own module (not in handlers/) so that the hub and spoke packages depend on nothing of the
standalone reconcile handlers.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections.abc import MutableMapping
from typing import Any

#: The workers and pools whose work writes to the cluster, for `settle` (weak: a closed link's pool goes).
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_POOLS: weakref.WeakSet[concurrent.futures.Executor] = weakref.WeakSet()


def start_background(slot: MutableMapping[str, Any], worker: Any, name: str) -> None:
    """Run `worker.run_forever()` on a daemon thread for the operator's life; `worker.stop` is the
    threading.Event that ends it."""
    thread = threading.Thread(target=worker.run_forever, name=name, daemon=True)
    slot.update(worker=worker, thread=thread)
    _THREADS.add(thread)
    thread.start()


def stop_background(slot: MutableMapping[str, Any], timeout: float) -> None:
    worker = slot.get("worker")
    if worker is not None:
        worker.stop.set()
        slot["thread"].join(timeout=timeout)


def track_pool(pool: concurrent.futures.Executor) -> concurrent.futures.Executor:
    """Have `settle` wait for ``pool``'s work (a pool closed with ``shutdown(wait=False)`` may still run)."""
    _POOLS.add(pool)
    return pool


def settle(timeout: float, *pools: concurrent.futures.Executor) -> bool:
    """Whether every background worker (`start_background`) and every tracked pool, and ``pools``, ended
    within ``timeout`` seconds in all. Pools are shut down (queued work cancelled, running work awaited);
    workers are not told to stop here (their cleanup handlers do that). The leader releases its Lease only
    when this is True: work still under way must not overlap with the next leader's."""
    deadline = time.monotonic() + timeout
    ended = True
    for thread in list(_THREADS):
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
            ended = ended and not thread.is_alive()
    for pool in [*pools, *_POOLS]:
        waiter = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True},
                                  name="settle", daemon=True)
        waiter.start()
        waiter.join(max(0.0, deadline - time.monotonic()))
        ended = ended and not waiter.is_alive()
    return ended
