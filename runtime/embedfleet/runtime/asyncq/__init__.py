"""Asynchronous inference on Redis: durable job queue, workers, webhooks, dead letters, vector cache.

Data flows one way: `routes` validates and `store.submit`s a job -> a Redis stream -> `worker`
embeds it through the replica's batch manager at low priority -> `store.complete` writes the result
once -> `webhooks` delivers it (retries, then the dead-letter stream that `jobs_cli` replays).
"""
