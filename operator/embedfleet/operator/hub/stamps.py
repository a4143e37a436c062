"""Wall-clock times as the hub writes them into status, and read back from it.

Separate because the cluster observation (clusters.py), the hub objects' status (reporting.py) and the
rollout decision of a placement pass (placing.py) all stamp and read the same format; one spelling, one place.
"""

from __future__ import annotations

from datetime import UTC, datetime


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def wall() -> str:
    return stamp(datetime.now(UTC))


def wall_stamp(seconds: float) -> str:
    return stamp(datetime.fromtimestamp(seconds, UTC))


def parse_wall(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def age(value: str | None) -> float | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (datetime.now(UTC) - parsed).total_seconds()
