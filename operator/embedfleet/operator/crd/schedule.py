"""``spec.autoscaling.schedule``: replica floors for known peaks, as Karmada's CronFederatedHPA and KEDA's
cron scaler give them.

Only the shape is checked here (so the CRD schema can say it); whether a cron expression parses and a
time zone exists is checked by the operator (validate.py, through autoscale_schedule.entry_problems), so
that a bad entry becomes one ``Accepted=False`` sentence naming the entry rather than a schema error.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from embedfleet.operator.crd.base import CamelModel

#: More entries than this is a calendar, not a schedule; each tick evaluates all of them.
MAX_SCHEDULE_ENTRIES = 16
SCHEDULE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ScheduleEntry(CamelModel):
    """One window of at least minReplicas replicas, from each start until the next end after it."""

    name: str = Field(
        min_length=1, max_length=63, pattern=SCHEDULE_NAME_PATTERN,
        description="Names the entry in the status, Events and error messages; unique within the schedule.",
    )
    start: str = Field(
        min_length=1, max_length=128,
        description="Five-field cron expression (minute hour day-of-month month day-of-week) in `timezone`: "
        "when the window opens.",
    )
    end: str = Field(
        min_length=1, max_length=128,
        description="Five-field cron expression in `timezone`: the window closes at the first occurrence "
        "strictly after the start that opened it.",
    )
    timezone: str = Field(
        default="UTC", min_length=1, max_length=64,
        description="IANA time zone the cron expressions are read in (e.g. Europe/Berlin).",
    )
    min_replicas: int = Field(ge=0, le=10000, description="The floor while the window is open.")


Schedule = Annotated[
    list[ScheduleEntry],
    Field(
        max_length=MAX_SCHEDULE_ENTRIES,
        # The API server then refuses two entries of one name (and merges patches by name).
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Floors raised for known peaks: while an entry's window is open the autoscaler keeps at "
        "least its minReplicas (the highest of the open entries; never above maxReplicas, and a fleet at "
        "zero is woken). When a window closes the fleet shrinks as the load asks, after the scale-down "
        "stabilization window.",
    ),
]
