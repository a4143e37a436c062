"""kopf glue for the spoke role: renew the heartbeat lease while the operator runs.

The heartbeat's throughput registry goes into kopf's operator-wide memo (``memo.throughput``): kopf gives
each object's handlers a shallow copy of it, so every autoscale daemon of this process records into the
same registry the heartbeat reads (handlers/autoscale_daemon.py).
"""

from __future__ import annotations

from typing import Any

import kopf

from embedfleet.operator.background import start_background, stop_background
from embedfleet.operator.spoke.heartbeat import LEASE_NAME, Heartbeat

BEAT: dict[str, Any] = {}


@kopf.on.startup()
def start_heartbeat(logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    beat = Heartbeat()
    memo.throughput = beat.measured
    start_background(BEAT, beat, "embedfleet-heartbeat")
    logger.info("spoke heartbeat: lease %s/%s every %.1fs", beat.namespace, LEASE_NAME, beat.interval)


@kopf.on.cleanup()
def stop_heartbeat(**_: Any) -> None:
    stop_background(BEAT, timeout=10)
