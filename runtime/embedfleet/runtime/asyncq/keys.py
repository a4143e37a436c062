"""Every Redis key the async path uses, in one place, under one prefix."""

from __future__ import annotations

from dataclasses import dataclass

JOB_GROUP = "workers"
WEBHOOK_GROUP = "senders"


@dataclass(frozen=True)
class Keys:
    prefix: str = "embedfleet"

    @property
    def jobs(self) -> str:
        """Stream of job ids to run (consumer group `workers`)."""
        return f"{self.prefix}:jobs"

    @property
    def unfinished(self) -> str:
        """Sorted set: job id -> submission time, for every accepted job not yet finished."""
        return f"{self.prefix}:unfinished"

    @property
    def webhooks(self) -> str:
        """Stream of webhook deliveries due now (consumer group `senders`)."""
        return f"{self.prefix}:webhooks"

    @property
    def webhooks_delayed(self) -> str:
        """Sorted set: delivery (job id + attempt) -> time it is due again after a failure."""
        return f"{self.prefix}:webhooks:delayed"

    @property
    def dead_letters(self) -> str:
        """Stream of webhook deliveries that failed every attempt."""
        return f"{self.prefix}:dlq"

    @property
    def stats(self) -> str:
        """Hash of counters: succeeded, failed, duplicates (results written twice and dropped)."""
        return f"{self.prefix}:stats"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def cache(self, digest: str, ids_hash: str) -> str:
        return f"{self.prefix}:cache:{digest}:{ids_hash}"
