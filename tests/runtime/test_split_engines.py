"""Several engine processes behind the fronts (`embedfleet serve --fronts N --engines M`): real processes.

Two fronts and two engines, each engine with its own copy of the model. What a client sees must not change:
the same bytes as one process, one quota per pod, one view of the metrics; the work is spread over both
engines; and an engine killed costs only what it held: the other keeps the pod serving and Ready.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.answers import assert_same_answer
from tests.procs import RuntimeServer, start_runtime
from tests.runtime.test_split import MODEL, TEXTS, assert_one_quota_per_pod, children, fresh

pytestmark = pytest.mark.timeout(600)
ENGINES = 2


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> RuntimeServer:
    keys = tmp_path_factory.mktemp("engines") / "keys.yaml"
    keys.write_text('tenants:\n  - name: open\n    keys: ["sk-engines-open-0123456789"]\n'
                    '  - name: metered\n    keys: ["sk-engines-metered-0123456789"]\n    tokens_per_minute: 120\n')
    srv = start_runtime("--fronts", "2", "--engines", str(ENGINES), "--api-keys", str(keys))
    srv.headers = {"authorization": "Bearer sk-engines-open-0123456789"}
    yield srv
    srv.stop()


def scrape(srv: RuntimeServer) -> dict[str, float]:
    """The model's samples of one /metrics page, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(page)
            for sample in family.samples if sample.labels.get("model") == MODEL}


def clients(srv: RuntimeServer, count: int, requests: int) -> Counter:
    """`count` clients at once, each sending `requests` requests of 32 texts in turn: their outcomes."""
    outcomes: list = []

    def one() -> None:
        with srv.client() as c:
            for i in range(requests):
                texts = [f"spread over the engines, request {i} text {j}" for j in range(32)]
                try:
                    outcomes.append(c.post("/v1/embeddings", json={"input": texts}).status_code)
                except httpx.TransportError as exc:
                    outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Counter(outcomes)


def test_both_engines_take_work_and_the_answers_are_one_process_s(engines, server):
    roles = children(engines)
    assert len(roles["engine"]) == ENGINES and len(roles["front"]) == 2, roles
    before = {pid: cpu_seconds(pid) for pid in roles["engine"]}
    outcomes = clients(engines, 4, 12)
    assert outcomes == {200: 48}, outcomes
    used = {pid: cpu_seconds(pid) - before[pid] for pid in roles["engine"]}
    # each engine ran a real share of the 1,536 inputs (all on one would leave the other near 0)
    assert min(used.values()) > 0.2 * max(used.values()), used
    cases = [("/v1/embeddings", {"input": TEXTS}), ("/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}),
             ("/embed", {"inputs": TEXTS, "normalize": False, "truncate": True}),
             ("/rerank", {"query": "fox", "texts": TEXTS}), ("/v1/embeddings", {"input": "x", "model": "nope"})]
    with server.client() as one:
        for path, body in cases:
            want = one.post(path, json=body)
            for _ in range(4):  # new connections, over both fronts and so both engines
                got = fresh(engines, "POST", path, json=body)
                assert_same_answer(got, want, path)


def test_a_tenant_quota_is_one_per_pod_across_engines(engines):
    """120 tokens a minute for the pod: were each engine to keep its own bucket, two engines would let
    through about twice that."""
    assert_one_quota_per_pod(engines, "sk-engines-metered-0123456789")


def test_the_metrics_count_every_engine_once(engines):
    before = engines.metric("embedfleet_inputs_total")
    for i in range(12):
        assert fresh(engines, "POST", "/embed", json={"inputs": [f"counted {i}", "twice"]}).status_code == 200
    assert engines.metric("embedfleet_inputs_total") - before == 24
    assert engines.metric("embedfleet_queue_tokens", model=MODEL) == 0
    assert engines.metric("embedfleet_ready") == 1


def test_the_expected_wait_metric_shows_an_engines_queue(engines):
    """Fronts hold no queue and write 0 for the gauge: the pod's reading must still be the engines' wait."""
    long_texts = ["a long input of many words to keep the engine busy " * 40] * 384

    def bulk() -> None:
        with engines.client() as c:
            c.post("/embed", json={"inputs": long_texts, "truncate": True})

    t = threading.Thread(target=bulk)
    t.start()
    seen = []
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:
        page = scrape(engines)  # both from one page: the queue may drain between two
        if page.get("embedfleet_queue_tokens", 0) > 0:
            seen.append((page["embedfleet_queue_tokens"], page["embedfleet_expected_wait_seconds"]))
        time.sleep(0.2)
    t.join()
    assert seen, "the queue was never seen"
    assert all(wait > 0 for _, wait in seen), seen


def test_an_engine_killed_leaves_the_pod_ready_and_serving_on_the_other(engines):
    victim = max(children(engines)["engine"])
    subprocess.run(["kill", "-KILL", str(victim)], check=True)
    time.sleep(0.5)  # the fronts see the link close at once; a request sent in that instant may get 503
    assert fresh(engines, "GET", "/ready").status_code == 200
    outcomes = clients(engines, 4, 5)
    assert outcomes == {200: 20}, outcomes
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        alive = children(engines)["engine"]
        if victim not in alive and len(alive) == ENGINES:
            break
        time.sleep(0.2)
    assert victim not in children(engines)["engine"] and len(children(engines)["engine"]) == ENGINES
    assert "was killed by signal 9; restarting it" in engines.log()
    engines.wait_ready(timeout=180)
    assert fresh(engines, "POST", "/v1/embeddings", json={"input": "after"}).status_code == 200


def test_more_than_one_engine_without_fronts_is_refused_with_the_reason():
    srv = start_runtime("--fronts", "0", "--engines", "2", wait_ready=False)
    try:
        assert srv.proc.wait(timeout=60) == 2
        assert "--engines 2 needs split serving" in srv.log() and "--fronts N" in srv.log()
    finally:
        srv.stop()
