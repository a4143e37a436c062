"""Every Redis key the async path uses, in one place, under one prefix per deployment.

The prefix carries the deployment (by default its served model name), so two deployments can share
one Redis without running, counting, reading or cache-probing each other's jobs: every key, the
vector cache's included, lives under `embedfleet:<deployment>:`. `--redis-prefix` replaces the
whole prefix, e.g. to keep the keys of an older release (`embedfleet`) or to tell apart two
deployments that serve the same model name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote

JOB_GROUP = "workers"
WEBHOOK_GROUP = "senders"
NAMESPACE = "embedfleet"


def deployment_prefix(served_names: Iterable[str]) -> str:
    """`embedfleet:<names>`: the served model names, sorted, percent-encoded and joined by `+`.

    Encoding (`:` and `+` included) keeps the mapping one-to-one: no name, nor set of names, can
    produce another deployment's prefix or a prefix that ends inside another's key names.
    """
    names = sorted(set(served_names))
    if not names:
        raise ValueError("a deployment serves at least one model name")
    return f"{NAMESPACE}:" + "+".join(quote(name, safe="._-") for name in names)


@dataclass(frozen=True)
class Keys:
    prefix: str = NAMESPACE  # the layout before deployments had their own keys; use `for_deployment`

    @classmethod
    def for_deployment(cls, served_names: Iterable[str], redis_prefix: str | None = None) -> Keys:
        """The keys of one deployment: an explicit prefix as given, else derived from its model names."""
        return cls(redis_prefix if redis_prefix else deployment_prefix(served_names))

    @property
    def jobs(self) -> str:
        """Stream of job ids to run (consumer group `workers`)."""
        return f"{self.prefix}:jobs"

    @property
    def jobs_delayed(self) -> str:
        """Sorted set: job id -> time it goes back onto `jobs` after a transient failure (backoff)."""
        return f"{self.prefix}:jobs:delayed"

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
