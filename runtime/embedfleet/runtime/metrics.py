"""Prometheus metrics of one runtime process.

The names are a contract with the operator's autoscaler, the gateway and the dashboards
(docs/metrics.md): keep them stable.
Each server owns its registry so tests can run several apps in one process.

Split serving (`--fronts`, split/) runs several processes: there PROMETHEUS_MULTIPROC_DIR is set before
prometheus_client is imported, every process writes its series to files in it, and `exposition()` adds them
up: counters and histograms summed, gauges as their `multiprocess_mode` says (the engine's gauges from the
engine, requests in flight summed over the live processes). Gauges read when scraped (`track`) are set
from their functions just before, in the process that serves /metrics (the first engine), and by every engine
each time it tells the fronts its load (split/engine_side.py): with several engines (`--engines`), the queues
are summed over them and the expected wait is the most loaded engine's (fronts hold 0 for it, so the largest
is the only reading that never hides an engine's wait).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import Gauge as _Gauge

from embedfleet.runtime import cold_start

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
SHED_REASONS = ("expected_wait", "queue_tokens", "deadline")
WEBHOOK_OUTCOMES = ("delivered", "retried", "dead_lettered")


MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
_TRACKED: list[tuple[_Gauge, Callable[[], float]]] = []


def Gauge(*args, multiprocess_mode: str = "livemax", **kwargs) -> _Gauge:
    """A gauge whose value, with several processes, is the largest any live one holds: every gauge here is
    set by one process (the engine's), the others hold 0 (or the same setting)."""
    return _Gauge(*args, multiprocess_mode=multiprocess_mode, **kwargs)


def track(gauge: _Gauge, read: Callable[[], float]) -> None:
    """`gauge` reads `read()` when scraped (with several processes: set from it before each exposition)."""
    if MULTIPROCESS:
        _TRACKED.append((gauge, read))
    else:
        gauge.set_function(read)


def refresh_tracked() -> None:
    """Set every tracked gauge of this process from its function (several processes only: one alone reads
    them as it is scraped)."""
    for gauge, read in _TRACKED:
        gauge.set(read())


class RuntimeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_in_flight = Gauge(
            "embedfleet_requests_in_flight", "Requests accepted and not yet answered", registry=r,
            multiprocess_mode="livesum")
        self.queue_tokens = Gauge("embedfleet_queue_tokens", "Tokens waiting for the engine", ["model"], registry=r,
                                  multiprocess_mode="livesum")
        self.queue_requests = Gauge(
            "embedfleet_queue_requests", "Requests with inputs waiting for the engine", ["model"], registry=r,
            multiprocess_mode="livesum")
        self.max_batch_requests = Gauge(
            "embedfleet_max_batch_requests", "Configured most inputs per engine batch", ["model"], registry=r)
        self.max_batch_tokens = Gauge(
            "embedfleet_max_batch_tokens", "Configured token budget per engine batch", ["model"], registry=r)
        self.max_queue_seconds = Gauge(
            "embedfleet_max_queue_seconds", "Configured bound on a request's expected wait (--max-queue-seconds); "
            "admission refuses work expected to wait longer", registry=r)
        self.expected_wait = Gauge(
            "embedfleet_expected_wait_seconds", "Queued tokens divided by measured tokens per second",
            ["model"], registry=r)
        self.request_duration = Histogram(
            "embedfleet_request_duration_seconds", "Time from accepting a request to answering it",
            ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "embedfleet_batch_size", "Inputs per engine batch", ["model"], buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "embedfleet_batch_tokens", "Tokens per engine batch, padding included (none on a packed engine)",
            ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.batch_seconds = Histogram(
            "embedfleet_batch_seconds", "Wall time of one engine batch, from its start on the engine thread to "
            "its end (pauses for preempting queries included)", ["model"], buckets=LATENCY_BUCKETS, registry=r)
        # The longest such batch since the process started: "one batch" in admission's promise (an accepted
        # request waits at most its bound plus one batch; docs/runtime.md), read by whoever checks it.
        self.batch_seconds_max = Gauge(
            "embedfleet_batch_seconds_max", "Longest wall time of one engine batch since the process started",
            ["model"], registry=r)
        self.inputs = Counter("embedfleet_inputs_total", "Inputs run through the engine", ["model"], registry=r)
        self.tokens = Counter(
            "embedfleet_tokens_total", "Tokens run through the engine (unpadded)", ["model"], registry=r)
        self.truncated = Counter(
            "embedfleet_truncated_inputs_total", "Inputs truncated to the model's limit", ["model"], registry=r)
        self.engine_busy = Counter(
            "embedfleet_engine_busy_seconds_total", "Seconds the engine spent running batches (utilisation)",
            ["model"], registry=r)
        self.shed = Counter(
            "embedfleet_requests_shed_total", "Requests refused at admission, by reason: expected_wait and "
            "queue_tokens (429), deadline (504: it could not finish in time); model \"*\": refused at the gate, for "
            "every model", ["model", "reason"], registry=r)
        self.expired = Counter(
            "embedfleet_deadline_expired_total", "Requests answered 504 because their deadline passed while "
            "they waited; their queued inputs never reached the engine", ["model"], registry=r)
        self.preempted = Counter(
            "embedfleet_preempted_batches_total", "Batches of queries run while a bulk batch paused between layers "
            "(--preempt-bulk): queries that waited for one layer of it, not all of it", ["model"], registry=r)
        self.engine_failures = Counter(
            "embedfleet_engine_failures_total", "Batches the engine failed (an error, or the wrong number of rows): "
            "their requests are answered 5xx (503 when it ran out of memory) and the server keeps serving; a run "
            "of them is an engine fault, not bad input", ["model"], registry=r)
        # per tenant (tenants.py; `default` without --api-keys): bounded by the keys file, so safe as labels
        self.tenant_requests = Counter(
            "embedfleet_tenant_requests_total", "Requests answered by the engine, per tenant", ["tenant", "model"],
            registry=r)
        self.tenant_tokens = Counter(
            "embedfleet_tenant_tokens_total", "Tokens run for a tenant (what its quota counts)", ["tenant", "model"],
            registry=r)
        self.tenant_refused = Counter(
            "embedfleet_tenant_refused_total", "A tenant's requests refused: quota (429), expected_wait and "
            "queue_tokens (429), deadline (504), model_not_allowed (403)", ["tenant", "reason"], registry=r)
        self.queue_wait = Histogram(
            "embedfleet_queue_wait_seconds", "Time from a request's admission until its last input entered the "
            "engine, per tenant", ["model", "tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("embedfleet_errors_total", "Error responses by HTTP status", ["code"], registry=r)
        self.ready = Gauge("embedfleet_ready", "1 when the server accepts work", registry=r,
                           multiprocess_mode="livemin")
        # async queue and embedding cache (embedfleet.runtime.asyncq)
        self.async_queue_depth = Gauge(
            "embedfleet_async_queue_depth", "Async jobs accepted and not yet finished (whole Redis queue)",
            registry=r)
        self.async_oldest_job = Gauge(
            "embedfleet_async_oldest_job_seconds", "Age of the oldest unfinished async job", registry=r)
        self.async_dead_letters = Gauge(
            "embedfleet_async_dead_letters", "Webhook deliveries in the dead-letter stream (whole Redis queue; "
            "`embedfleet jobs dlq` lists and replays them)", registry=r)
        self.async_webhooks = Counter(
            "embedfleet_async_webhooks_total", "Webhook delivery attempts this process finished, by outcome: "
            "delivered, retried (scheduled again), dead_lettered", ["outcome"], registry=r)
        self.cache_hits = Counter("embedfleet_cache_hits_total", "Inputs answered from the embedding cache",
                                  registry=r)
        self.cache_misses = Counter("embedfleet_cache_misses_total", "Inputs the embedding cache did not have",
                                    registry=r)
        self.cache_hit_ratio = Gauge(
            "embedfleet_cache_hit_ratio", "Cache hits / lookups since start", registry=r)
        # exported only for models started with dtype fp8 (a 0 for the others would read as a failure)
        self.fp8_min_cosine = Gauge(
            "embedfleet_fp8_min_cosine", "FP8 quality gate: lowest cosine of a calibration output with bf16 "
            "(rerankers: correlation of scores)", ["model"], registry=r)
        self.fp8_accepted = Gauge(
            "embedfleet_fp8_accepted", "FP8 quality gate: 1 when FP8 is served, 0 after a fall back to bf16",
            ["model"], registry=r)
        # revisions, fingerprints and drift (probe.py, drift.py; docs/rollouts.md)
        self.model_info = Gauge(
            "embedfleet_model_info", "1 per served model: its revision, vector space and probe fingerprint",
            ["model", "revision", "vector_space", "fingerprint"], registry=r)
        self.probe_cosine = Gauge(
            "embedfleet_probe_cosine", "Drift check: lowest cosine of the last probe re-run's outputs with the "
            "reference (--probe-reference, else the start-up probe)", ["model"], registry=r)
        self.probe_order_kept = Gauge(
            "embedfleet_probe_order_kept", "Drift check: 1 when the last probe re-run kept the reference's order "
            "(similarity pairs; rerankers/classifiers: top-1 and score order)", ["model"], registry=r)
        self.probe_checks = Counter(
            "embedfleet_probe_checks_total", "Drift checks by outcome: ok, drift (outside --probe-min-cosine or "
            "order changed), error (the check could not run)", ["model", "outcome"], registry=r)
        # this process's start, phase by phase (cold_start.py; docs/observability.md, "Cold starts")
        self.cold_start_seconds = Histogram(
            "embedfleet_cold_start_seconds", "This process's start by phase: weights (arrival, from where: "
            "embedfleet_weights_source_info), weights_verify, engine_load, warmup (per model); ready and "
            "first_request (from process start)", ["phase"], buckets=cold_start.BUCKETS, registry=r)
        self.weights_source = Gauge(
            "embedfleet_weights_source_info", "1 per served model: where its weights came from (cache, peer, "
            "origin, downloaded, in-image)", ["model", "source"], registry=r)
        self.engine_source = Gauge(
            "embedfleet_engine_source_info", "1 per served model whose engine builds something from the weights "
            "(int8, trtllm): where the build it loads came from (built, cache, peer)", ["model", "source"],
            registry=r)
        self.cold_start = cold_start.ColdStart(self.cold_start_seconds, self.weights_source,
                                               engine_info=self.engine_source)

    def exposition(self) -> CollectorRegistry:
        """What /metrics writes out: this registry, or with several processes all of their files."""
        if not MULTIPROCESS:
            return self.registry
        from prometheus_client import multiprocess

        refresh_tracked()
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return merged

    def for_model(self, name: str) -> ModelMetrics:
        """The per-model series (label `model`), so each model's queue is visible on its own."""
        shed = {f"shed_{reason}": self.shed.labels(name, reason) for reason in SHED_REASONS}
        # memoized: `labels()` takes a lock and builds its key on every call, and these are on every
        # request's path (tenants are bounded by the keys file)
        per_tenant = {"queue_wait": cache(partial(self.queue_wait.labels, name)),
                      "tenant_requests": cache(lambda tenant: self.tenant_requests.labels(tenant, name)),
                      "tenant_tokens": cache(lambda tenant: self.tenant_tokens.labels(tenant, name))}
        return ModelMetrics(**{f: getattr(self, f).labels(name) for f in ModelMetrics.__dataclass_fields__
                               if not f.startswith("shed_") and f not in per_tenant}, **shed, **per_tenant)


@dataclass(frozen=True)
class ModelMetrics:
    queue_tokens: Gauge
    queue_requests: Gauge
    max_batch_requests: Gauge
    max_batch_tokens: Gauge
    expected_wait: Gauge
    batch_size: Histogram
    batch_tokens: Histogram
    batch_seconds: Histogram
    batch_seconds_max: Gauge
    inputs: Counter
    tokens: Counter
    truncated: Counter
    engine_busy: Counter
    expired: Counter
    preempted: Counter
    engine_failures: Counter
    shed_expected_wait: Counter
    shed_queue_tokens: Counter
    shed_deadline: Counter
    queue_wait: Callable[[str], Histogram]  # by tenant
    tenant_requests: Callable[[str], Counter]  # by tenant
    tenant_tokens: Callable[[str], Counter]  # by tenant
