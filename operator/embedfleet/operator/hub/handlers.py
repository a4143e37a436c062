"""kopf glue for the hub role: run the scheduling loop for as long as the operator runs.

The hub deliberately registers no EmbeddingDeployment reconcile handlers: on the hub an
EmbeddingDeployment is an intent that spokes run, never pods of its own.
"""

from __future__ import annotations

from typing import Any

import kopf

from embedfleet.operator.handlers.common import start_background, stop_background
from embedfleet.operator.hub.loop import HubLoop

LOOP: dict[str, Any] = {}


@kopf.on.startup()
def start_hub_loop(logger: kopf.Logger, **_: Any) -> None:
    loop = HubLoop()
    start_background(LOOP, loop, "embedfleet-hub")
    logger.info("hub scheduling loop started (interval %.1fs, return ramp %.0fs)", loop.interval, loop.ramp)


@kopf.on.cleanup()
def stop_hub_loop(**_: Any) -> None:
    stop_background(LOOP, timeout=30)
