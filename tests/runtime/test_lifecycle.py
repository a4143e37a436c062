"""Probes, graceful drain on SIGTERM, dropping work of clients that left, start-up validation."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx

from embedfleet.gateway.upstreams import server_timing, server_timing_s
from tests.procs import child_env, free_port

CONTRACT = [
    "embedfleet_requests_in_flight", "embedfleet_queue_tokens", "embedfleet_queue_requests",
    "embedfleet_max_batch_requests", "embedfleet_max_batch_tokens", "embedfleet_expected_wait_seconds",
    "embedfleet_request_duration_seconds_count", "embedfleet_batch_size_count", "embedfleet_batch_tokens_count",
    "embedfleet_inputs_total", "embedfleet_tokens_total", "embedfleet_truncated_inputs_total",
]


def test_answers_say_where_their_time_went(runtime_factory):
    """server-timing's parts and TEI's x-*-time headers: tokenization, queue and inference are parts of
    the total the gate measured, and the engine's part is not zero."""
    srv = runtime_factory()
    with srv.client() as c:
        for route, body in (("/v1/embeddings", {"input": ["one", "two three"]}), ("/embed", {"inputs": "four"})):
            answer = c.post(route, json=body)
            assert answer.status_code == 200, answer.text
            parts = server_timing(answer.headers["server-timing"])
            assert set(parts) == {"total", "tokenize", "queue", "inference"}, parts
            assert parts["inference"] > 0 and parts["tokenize"] > 0 and parts["queue"] >= 0
            # disjoint parts of the total (the total is rounded to 0.01 ms, the parts to 0.001 ms)
            assert parts["tokenize"] + parts["queue"] + parts["inference"] <= parts["total"] + 0.00002, parts
            for name, tei in (("total", "x-total-time"), ("tokenize", "x-tokenization-time"),
                              ("queue", "x-queue-time"), ("inference", "x-inference-time")):
                assert abs(int(answer.headers[tei]) - parts[name] * 1000) <= 0.51, (tei, answer.headers[tei], parts)
        refused = c.post("/v1/embeddings", json={"input": "x", "model": "nope"})
        assert refused.status_code == 404
        assert server_timing(refused.headers["server-timing"])["inference"] == 0  # no engine work was done
        assert "server-timing" not in c.get("/health").headers  # not admitted work: no timing


def test_metrics_contract_with_real_values(runtime_factory):
    srv = runtime_factory("--max-batch-requests", "16", "--max-batch-tokens", "4096")
    with srv.client() as c:
        answer = c.post("/v1/embeddings", json={"input": ["one", "two three", "four five six"]})
        c.post("/v1/embeddings", json={"input": "x", "model": "nope"})
        load = c.get("/load").json()
    # the load a gateway picks replicas by, on every answer and from a cheap poll
    assert float(answer.headers["x-embedfleet-expected-wait"]) >= 0
    assert server_timing_s(answer.headers["server-timing"]) > 0
    assert load["ready"] is True and load["draining"] is False and load["in_flight"] == 0
    (model,) = load["models"].values()
    assert model["queue_tokens"] == 0 and model["expected_wait_s"] == 0
    assert model["tokens_per_s"] > 0  # seeded by the start-up batch
    for name in CONTRACT:
        srv.metric(name)  # raises if missing
    assert srv.metric("embedfleet_max_batch_requests") == 16
    assert srv.metric("embedfleet_max_batch_tokens") == 4096
    assert srv.metric("embedfleet_inputs_total") == 3
    assert srv.metric("embedfleet_tokens_total") == 3 + 4 + 5
    assert srv.metric("embedfleet_request_duration_seconds_count") == 2
    assert srv.metric("embedfleet_errors_total") == 1
    assert "embedfleet_errors_total{code=\"404\"}" in httpx.get(f"{srv.url}/metrics").text
    assert srv.metric("embedfleet_requests_in_flight") == 0


def test_models_and_openapi(server):
    with server.client() as c:
        models = c.get("/v1/models").json()
        spec = c.get("/openapi.json").json()
    card = models["data"][0]
    assert card["id"] == "all-MiniLM-L6-v2" and card["dimensions"] == 384 and card["max_input_tokens"] == 256
    assert card["digest"].startswith("sha256:")
    for path in ("/v1/embeddings", "/embed", "/tokenize", "/v1/models", "/health", "/ready", "/metrics"):
        assert path in spec["paths"]
    body = spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("OpenAIEmbeddingRequest")
    assert "encoding_format" in spec["components"]["schemas"]["OpenAIEmbeddingRequest"]["properties"]


def test_ready_is_false_while_loading(runtime_factory):
    srv = runtime_factory(wait_ready=False)
    seen = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{srv.url}/health", timeout=2)
            ready = httpx.get(f"{srv.url}/ready", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        assert health.status_code == 200
        seen.add((ready.status_code, ready.json()["status"]))
        if ready.status_code == 200:
            break
        resp = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "early"}, timeout=10)
        assert resp.status_code in (503, 200)
        time.sleep(0.02)
    assert (200, "ready") in seen
    assert (503, "loading") in seen


def test_sigterm_drains_accepted_requests(runtime_factory):
    # Admission's bound out of the way (this checks the drain, not admission): on a loaded machine the later
    # requests would otherwise be refused (429) as the engine slows, leaving too few in flight to drain.
    srv = runtime_factory("--drain-timeout", "60", "--max-queue-seconds-bulk", "3600")
    texts = [f"request {{}} passage {i} " + "words " * 60 for i in range(32)]

    async def load() -> list[httpx.Response | Exception]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            async def one(k: int):
                try:
                    return await client.post("/v1/embeddings", json={"input": [t.format(k) for t in texts]})
                except httpx.HTTPError as exc:
                    return exc

            tasks = [asyncio.create_task(one(k)) for k in range(8)]
            while srv.metric("embedfleet_requests_in_flight") < 6:
                await asyncio.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            ready = await client.get("/ready")
            polled = await client.get("/load")
            late = await client.post("/v1/embeddings", json={"input": "after SIGTERM"})
            results = await asyncio.gather(*tasks)
            return [ready, polled, late, *results]

    ready, polled, late, *results = asyncio.run(load())
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert polled.json()["draining"] is True and polled.json()["ready"] is False
    assert polled.json()["in_flight"] >= 1
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    assert "draining" in late.json()["error"]["message"]
    assert srv.proc.wait(60) == 0
    ok = [r for r in results if isinstance(r, httpx.Response) and r.status_code == 200]
    # every request the server accepted got its full answer; none was cut off
    assert not [r for r in results if isinstance(r, Exception)], results
    assert all(len(r.json()["data"]) == 32 for r in ok)
    assert len(ok) >= 6, [(r.status_code, r.text[:120]) for r in results if isinstance(r, httpx.Response)]


def test_disconnected_client_work_is_dropped(runtime_factory):
    # admission's bulk bound out of the way: this is about a client leaving, and on a loaded machine the 12k
    # tokens of `first` can be expected to take longer than the default 30 s (a 429, not what is tested here)
    srv = runtime_factory("--max-batch-requests", "8", "--urgent-max-inputs", "0", "--max-queue-seconds-bulk", "3600")
    first = [f"first {i} " + "tokens " * 120 for i in range(96)]
    second = [f"second {i} " + "tokens " * 120 for i in range(96)]

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as client:
            keep = asyncio.create_task(client.post("/v1/embeddings", json={"input": first}))
            while srv.metric("embedfleet_queue_requests") < 1:
                await asyncio.sleep(0.005)
            async with httpx.AsyncClient(base_url=srv.url, timeout=0.3) as impatient:
                try:
                    await impatient.post("/v1/embeddings", json={"input": second})
                except httpx.TimeoutException:
                    pass
            resp = await keep
            return resp.status_code

    assert asyncio.run(scenario()) == 200
    deadline = time.monotonic() + 60
    while srv.metric("embedfleet_queue_tokens") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    embedded = srv.metric("embedfleet_inputs_total")
    assert 96 <= embedded < 96 + 96, f"{embedded} inputs embedded: the abandoned request was not dropped"
    assert srv.metric("embedfleet_queue_requests") == 0


def test_bad_config_refuses_to_start_naming_the_field():
    for flags, env, field in (
        (["--max-batch-tokens", "0"], {}, "max_batch_tokens"),
        (["--dtype", "int3"], {}, "dtype"),
        ([], {"EMBEDFLEET_MAX_BATCH_REQUESTS": "many"}, "max_batch_requests"),
        (["--model", "/nonexistent/model"], {}, "model"),
    ):
        proc = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--port", str(free_port()),
                               *flags], env=child_env(env), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert field.replace("_", "-") in proc.stderr or field in proc.stderr, proc.stderr


def test_help_documents_every_flag_and_default():
    out = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "serve", "--help"], env=child_env(),
                         capture_output=True, text=True, timeout=60).stdout
    from embedfleet.runtime.settings import RuntimeSettings

    for name in RuntimeSettings.model_fields:
        assert "--" + name.replace("_", "-") in out
        assert "EMBEDFLEET_" + name.upper() in out
    assert "default: 16384" in out
