"""Operator-wide kopf settings: our annotation prefix and finalizer, timeouts that survive idle watches."""

from __future__ import annotations

from typing import Any

import kopf

PREFIX = "embedfleet.dev"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    # Long-running watches get cut by load balancers; reconnect well before typical idle limits.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    # A stream with no event (bookmarks included) for this long is reconnected. Seen after an API
    # server restart: a resumed watch that never delivers; kopf's 70 s default left self-healing off
    # for that long.
    settings.watching.inactivity_timeout = 45
    settings.posting.enabled = True
    # Sync handlers do blocking API calls on kopf's executor; its default (CPUs + 4 threads: 6 on two
    # cores) queues hundreds of objects behind a few slow calls.
    settings.execution.max_workers = 20
    # A deleted object keeps its finalizer until its daemons and timers have exited. kopf gives them ten
    # event-loop cycles to exit at once and, for a timer still running its handler then, looks again only
    # after 60 s: a busy loop or a resync converge in flight held a deletion for a minute (seen in CI,
    # `kubectl delete --wait` timing out). Wait up to a second for the exit, and look again every 2 s.
    settings.background.instant_exit_timeout = 1.0
    settings.background.cancellation_polling = 2.0
