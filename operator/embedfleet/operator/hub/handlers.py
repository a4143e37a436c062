"""kopf glue for the hub role: run the hub's controller (controller.py) for as long as the operator runs.

The hub deliberately registers no EmbeddingDeployment reconcile handlers: on the hub an
EmbeddingDeployment is an intent that spokes run, never pods of its own.

A standby replica is warm: while it waits for the leader Lease (main.py), ``warm_standby`` already runs the
controller's informers (hub collections and every spoke's copies and heartbeat), so when it takes over its
first reconciles read a current view instead of listing the whole fleet first. It writes nothing until it
leads.
"""

from __future__ import annotations

import threading
from typing import Any

import kopf

from embedfleet.operator.background import start_background, stop_background
from embedfleet.operator.hub.controller import HubController

LOOP: dict[str, Any] = {}


def warm_standby() -> HubController:
    """Start watching before leading (called by main.py while it waits for the Lease)."""
    loop = HubController()
    LOOP["warm"] = loop
    threading.Thread(target=loop.warm, name="embedfleet-hub-warm", daemon=True).start()
    return loop


@kopf.on.startup()
def start_hub_loop(logger: kopf.Logger, **_: Any) -> None:
    loop = LOOP.pop("warm", None) or HubController()
    start_background(LOOP, loop, "embedfleet-hub")
    logger.info("hub controller started (resync %.1fs, return ramp %.0fs)", loop.interval, loop.ramp)


@kopf.on.cleanup()
def stop_hub_loop(**_: Any) -> None:
    stop_background(LOOP, timeout=30)
