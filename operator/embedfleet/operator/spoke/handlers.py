"""kopf glue for the spoke role: renew the heartbeat lease while the operator runs."""

from __future__ import annotations

import threading
from typing import Any

import kopf

from embedfleet.operator.spoke.heartbeat import Heartbeat

BEAT: dict[str, Any] = {}


@kopf.on.startup()
def start_heartbeat(logger: kopf.Logger, **_: Any) -> None:
    beat = Heartbeat()
    thread = threading.Thread(target=beat.run_forever, name="embedfleet-heartbeat", daemon=True)
    BEAT.update(beat=beat, thread=thread)
    thread.start()
    logger.info("spoke heartbeat: lease %s/embedfleet-spoke every %.1fs", beat.namespace, beat.interval)


@kopf.on.cleanup()
def stop_heartbeat(**_: Any) -> None:
    beat: Heartbeat | None = BEAT.get("beat")
    if beat is not None:
        beat.stop.set()
        BEAT["thread"].join(timeout=10)
