"""Every dashboard panel's query, run by a real Prometheus against a real fleet under load, returns data.

The fleet: a runtime (embedded all-MiniLM, async path on a real redis-server, webhooks to a real receiver)
behind gateway B (region us-1), and gateway A (region eu-1) whose own replica is never up, so it spills to B
and holds, then times out, requests for a second deployment. Prometheus scrapes all three every second and
adds `region` (and `deployment` for the runtime) as target labels, as the relabelling in
docs/observability.md does in a cluster.

The load makes each panel's event happen for real: a cold start (requests held by B while the runtime
loads), a few hundred requests with more concurrency than the runtime admits (429s), spill from A to B,
5xx from A's hold timeout, truncated inputs, cache hits, and async jobs whose webhooks are delivered,
retried and dead-lettered. Then every target of every panel is sent to /api/v1/query with its template
variables substituted: region and deployment by the values their own `label_values` queries find (so a
panel only returns data when the labels it filters by exist), $__rate_interval by a window covering the
run. The test fails naming the dashboard, panel and query that did not parse or returned nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.asyncq.procs import RedisServer, WebhookReceiver, start_redis
from tests.gateway.conftest import MODEL, GatewayServer, start_gateway, wait_for
from tests.observability import panels
from tests.observability.prometheus import PROMETHEUS, PrometheusServer, scrape_config, start_prometheus
from tests.observability.test_alert_rules import RULES
from tests.procs import ROOT, RuntimeServer, child_env, free_port, spawn

pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="prometheus is not installed")

SECRET = "whsec-test-only"
#: Dashboards of components this fleet does not run: the operator's has its own live test on a real API
#: server (test_operator_dashboard_live.py).
NOT_IN_THIS_FLEET = {"operator.json"}
RUNTIME_DASHBOARDS = [p for p in panels.dashboard_files() if p.name not in NOT_IN_THIS_FLEET]
DEAD = "offline"  # gateway A's second deployment: its only replica never comes up, and nothing spills it
WINDOW = "10m"  # $__rate_interval and $__range: longer than the whole run, so every event is in the window
SYNC_REQUESTS = 240  # three at a time: under the runtime's --max-concurrent-requests 4, all answered
BURST = 24  # then sixteen at a time: over it, so some are refused with 429
MAX_QUEUE_SECONDS = 7.0
OK_JOBS, DOWN_JOBS = 5, 2  # async jobs whose webhook receiver answers 200, and 503 (two attempts each)


@dataclass
class Fleet:
    runtime: RuntimeServer
    gateway_a: GatewayServer
    gateway_b: GatewayServer
    redis: RedisServer
    receiver: WebhookReceiver
    prometheus: PrometheusServer
    codes: dict[int, int]


def start_runtime_on(port: int, *flags: str) -> RuntimeServer:
    """`embedfleet serve` on a port chosen before it starts (gateway B already points at it)."""
    log = tempfile.NamedTemporaryFile(prefix="embedfleet-serve-", suffix=".log", delete=False)
    proc = spawn([sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                  *flags], stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
    return RuntimeServer(proc, port, Path(log.name))


def embed(url: str, model: str, text: str | list[str], timeout: float = 180) -> int:
    return httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": text}, timeout=timeout).status_code


async def burst(url: str, n: int, concurrency: int, fresh: str = "") -> list[int]:
    """n embedding requests, `concurrency` at a time; some long enough to be truncated, some repeated.

    `fresh`: a prefix that makes every text new to the runtime's cache, so each request reaches the engine
    and stays in flight while it is batched (cache hits answer in well under a millisecond, and on a fast
    machine sixteen of them never overlap past the runtime's limit of four: seen in CI)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> int:
            if fresh:
                text = f"{fresh} {i}: " + "a longer text about fleets of embedding servers " * 8
            else:
                text = "word " * 600 if i % 40 == 0 else f"request {i % 50} about fleets of embedding servers"
            async with gate:
                return (await client.post("/v1/embeddings", json={"model": MODEL, "input": text})).status_code
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def metric(server: RuntimeServer, name: str, **labels: str) -> float:
    try:
        return server.metric(name, **labels)
    except (KeyError, httpx.HTTPError):
        return 0.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    started: list = []
    try:
        redis = start_redis()
        started.append(redis)
        receiver = WebhookReceiver(lambda path, nth: 200 if path == "/ok" else 503)
        receiver.start()
        runtime_port, dead_port = free_port(), free_port()
        gateway_b = start_gateway("--upstream", f"{MODEL}=http://127.0.0.1:{runtime_port}", "--region", "us-1",
                                  "--hold-timeout", "300")
        started.append(gateway_b)
        gateway_a = start_gateway("--upstream", f"{MODEL}=http://127.0.0.1:{dead_port}",
                                  "--upstream", f"{DEAD}=http://127.0.0.1:{dead_port}", "--region", "eu-1",
                                  "--spill", f"{MODEL}=us-1={gateway_b.url}", "--spill-after", "0",
                                  "--hold-timeout", "1")
        started.append(gateway_a)
        prometheus = start_prometheus(scrape_config({
            "embedfleet-runtime": [(f"127.0.0.1:{runtime_port}", {"region": "us-1", "deployment": MODEL})],
            "embedfleet-gateway": [(f"127.0.0.1:{gateway_a.port}", {"region": "eu-1"}),
                                   (f"127.0.0.1:{gateway_b.port}", {"region": "us-1"})],
        }, rule_files=[RULES]))
        started.append(prometheus)

        codes: dict[int, int] = {}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # a cold start: B holds these until the runtime it points at has loaded
            held = [pool.submit(embed, gateway_b.url, MODEL, f"held {i}") for i in range(3)]
            wait_for(lambda: gateway_b.load()[MODEL]["held"] == 3, "gateway B to hold 3 requests")
            runtime = start_runtime_on(runtime_port, "--redis-url", redis.url, "--webhook-secret", SECRET,
                                       "--webhook-allow-private", "--webhook-max-attempts", "2",
                                       "--webhook-backoff", "0.2", "--cache-enabled", "--max-concurrent-requests", "4",
                                       "--max-queue-seconds", str(MAX_QUEUE_SECONDS),
                                       "--probe-interval", "2")  # the probe drift panel needs a re-check
            started.append(runtime)
            runtime.wait_ready()
            assert [f.result() for f in held] == [200] * 3
        # the steady traffic the rate panels show: SYNC_REQUESTS answered. Three at a time stay under the limit,
        # but admission may still refuse some where a loaded machine stalls the engine (a batch overrunning lowers
        # the measured rate, as it should): the scene is then set again with what is missing, not judged
        for _ in range(4):
            for code in asyncio.run(burst(gateway_b.url, SYNC_REQUESTS - codes.get(200, 0), 3)):
                codes[code] = codes.get(code, 0) + 1
            if codes.get(200, 0) >= SYNC_REQUESTS:
                break
        for attempt in range(5):  # over the limit until some are refused (each burst almost always is)
            for code in asyncio.run(burst(gateway_b.url, BURST, 16, fresh=f"burst {attempt}")):
                codes[code] = codes.get(code, 0) + 1
            if codes.get(429):
                break
        # the bursts' aftermath gone (nothing in flight or queued on the runtime, its replica routable in B's
        # view) before A spills to B: B passes on the runtime's refusals, and a loaded machine drains slowly
        def idle() -> bool:
            load = httpx.get(f"{runtime.url}/load", timeout=10).json()
            return load["in_flight"] == 0 and all(m["queue_tokens"] == 0 for m in load["models"].values())

        wait_for(idle, "the runtime idle after the bursts", timeout=120)
        wait_for(lambda: gateway_b.load()[MODEL]["ready_replicas"] == 1, "B routing to its replica", timeout=60)
        for i in range(10):  # spilled from A (its own replica is down) to B, in two waves a few scrapes apart
            assert embed(gateway_a.url, MODEL, f"spilled {i}") == 200
            if i == 4:
                time.sleep(2.5)
        assert embed(gateway_a.url, DEAD, "nobody serves this") == 503  # held 1 s, then 503 cold_start
        with runtime.client() as c:
            for i, path in enumerate(["/ok"] * OK_JOBS + ["/down"] * DOWN_JOBS):
                job = c.post("/async/v1/embeddings", json={"input": [f"async {i}", "repeated input"],
                                                           "webhook_url": f"{receiver.url}{path}"})
                assert job.status_code == 202, job.text
        wait_for(lambda: metric(runtime, "embedfleet_async_dead_letters") >= DOWN_JOBS, "the dead letters", timeout=60)
        wait_for(lambda: metric(runtime, "embedfleet_async_webhooks_total", outcome="delivered") >= OK_JOBS,
                 "the delivered webhooks", timeout=60)
        # what the fleet counted has reached Prometheus: the last events (dead letters) are in its TSDB
        wait_for(lambda: bool(prometheus.query(f"embedfleet_async_dead_letters >= {DOWN_JOBS}")),
                 "Prometheus to scrape them",
                 timeout=30)
        wait_for(lambda: bool(prometheus.query("embedfleet_probe_cosine")), "a probe re-check scraped", timeout=60)
        # two more scrapes of every target (counted in Prometheus' own samples of `up`, however late a loaded
        # machine makes them): rates have a sample after the last event
        def scrapes() -> dict[str, float]:
            return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                    for r in prometheus.query("count_over_time(up[1h])")}

        before = scrapes()
        wait_for(lambda: all(scrapes().get(k, 0) >= v + 2 for k, v in before.items()),
                 "two more scrapes of every target", timeout=60)
        yield Fleet(runtime, gateway_a, gateway_b, redis, receiver, prometheus, codes)
    finally:
        for server in reversed(started):
            server.stop()
        if "receiver" in locals():
            receiver.stop()


def test_the_load_made_the_events_the_panels_show(fleet: Fleet) -> None:
    """The load did what the panels are meant to show (otherwise an empty panel would prove nothing)."""
    assert fleet.codes.get(429, 0) > 0 and fleet.codes.get(200, 0) >= SYNC_REQUESTS, fleet.codes
    assert fleet.gateway_b.count("embedfleet_gateway_cold_start_seconds_count", deployment=MODEL) >= 1
    assert fleet.gateway_a.count("embedfleet_gateway_spilled_total", deployment=MODEL, to="us-1") == 10
    assert fleet.gateway_a.count("embedfleet_gateway_requests_total", deployment=DEAD, code="503") == 1
    outcomes = {o: metric(fleet.runtime, "embedfleet_async_webhooks_total", outcome=o)
                for o in ("delivered", "retried", "dead_lettered")}
    # --webhook-max-attempts 2: a failing delivery is retried once, then dead-lettered
    assert outcomes == {"delivered": OK_JOBS, "retried": DOWN_JOBS, "dead_lettered": DOWN_JOBS}
    assert metric(fleet.runtime, "embedfleet_async_dead_letters") == DOWN_JOBS
    assert metric(fleet.runtime, "embedfleet_truncated_inputs_total") > 0
    assert metric(fleet.runtime, "embedfleet_max_queue_seconds") == MAX_QUEUE_SECONDS
    # the cold-start row: this runtime's own start, phase by phase, its weights from the image
    for phase in ("weights", "engine_load", "warmup", "ready", "first_request"):
        assert metric(fleet.runtime, "embedfleet_cold_start_seconds_count", phase=phase) == 1, phase
    assert metric(fleet.runtime, "embedfleet_weights_source_info", source="in-image") == 1


@pytest.mark.parametrize("path", RUNTIME_DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_query_returns_data(fleet: Fleet, path) -> None:
    board = panels.load(path)
    values = panels.variable_values(fleet.prometheus, board, WINDOW)
    failures, checked = [], 0
    for q in panels.queries(board):
        expr = panels.substitute(q.expr, values)
        try:
            result = fleet.prometheus.query(expr)
        except AssertionError as exc:
            failures.append(f"{q.where()}: Prometheus refused it ({exc}):\n    {expr}")
            continue
        checked += 1
        if not result:
            failures.append(f"{q.where()}: no data:\n    {expr}")
    assert not failures, "\n".join(failures)
    assert checked == len(list(panels.queries(board))) > 0


def test_alert_rules_evaluate_on_the_live_series(fleet: Fleet) -> None:
    """Prometheus loaded the rules file and evaluates every rule without an error on real series."""
    groups = fleet.prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == sum(1 for _ in rules) > 0
    wait_for(lambda: all(r.get("lastEvaluation", "").startswith("20") for r in
                         (x for g in fleet.prometheus.api("rules")["groups"] for x in g["rules"])),
             "every rule to be evaluated", timeout=30)
    bad = [f"{r['name']}: {r.get('lastError')}" for g in fleet.prometheus.api("rules")["groups"] for r in g["rules"]
           if r["health"] != "ok"]
    assert not bad, bad


@pytest.mark.parametrize("path", RUNTIME_DASHBOARDS, ids=lambda p: p.stem)
def test_every_panel_filters_by_region(fleet: Fleet, path) -> None:
    """The same queries for a region nobody scrapes return nothing: the data above came through the filter,
    not around it."""
    board = panels.load(path)
    values = {**panels.variable_values(fleet.prometheus, board, WINDOW), "region": "nowhere"}
    leaks = [f"{q.where()}: {panels.substitute(q.expr, values)}" for q in panels.queries(board)
             if fleet.prometheus.query(panels.substitute(q.expr, values))]
    assert not leaks, "\n".join(leaks)
