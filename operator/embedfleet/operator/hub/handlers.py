"""kopf glue for the hub role: run the scheduling loop for as long as the operator runs.

The hub deliberately registers no EmbeddingDeployment reconcile handlers: on the hub an
EmbeddingDeployment is an intent that spokes run, never pods of its own.
"""

from __future__ import annotations

import threading
from typing import Any

import kopf

from embedfleet.operator.hub.loop import HubLoop

LOOP: dict[str, Any] = {}


@kopf.on.startup()
def start_hub_loop(logger: kopf.Logger, **_: Any) -> None:
    loop = HubLoop()
    thread = threading.Thread(target=loop.run_forever, name="embedfleet-hub", daemon=True)
    LOOP.update(loop=loop, thread=thread)
    thread.start()
    logger.info("hub scheduling loop started (interval %.1fs, return ramp %.0fs)", loop.interval, loop.ramp)


@kopf.on.cleanup()
def stop_hub_loop(**_: Any) -> None:
    loop: HubLoop | None = LOOP.get("loop")
    if loop is not None:
        loop.stop.set()
        LOOP["thread"].join(timeout=30)
