"""A worker that lives as long as the operator: the hub's scheduling loop, the spoke's heartbeat.

Its own module (not in handlers/) so that the hub and spoke packages depend on nothing of the
standalone reconcile handlers.
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from typing import Any


def start_background(slot: MutableMapping[str, Any], worker: Any, name: str) -> None:
    """Run `worker.run_forever()` on a daemon thread for the operator's life; `worker.stop` is the
    threading.Event that ends it."""
    thread = threading.Thread(target=worker.run_forever, name=name, daemon=True)
    slot.update(worker=worker, thread=thread)
    thread.start()


def stop_background(slot: MutableMapping[str, Any], timeout: float) -> None:
    worker = slot.get("worker")
    if worker is not None:
        worker.stop.set()
        slot["thread"].join(timeout=timeout)
