"""Split serving (`embedfleet serve --fronts N`, runtime split/): real processes over real sockets.

One supervisor, one engine process and two fronts sharing the listening socket. Each test judges what a
client sees or what the server's own metrics say: the same bytes as the single-process server, one quota
and one view of the metrics per pod however the connections spread over the fronts, a front killed under
load costing only the requests it held, and an engine killed answering 503 instead of hanging.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.abuse import rawhttp
from tests.answers import assert_same_answer
from tests.procs import RuntimeServer

pytestmark = pytest.mark.timeout(600)
FRONTS = 2
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 12, "x", "Καλημέρα κόσμε", "über"] * 2


def children(srv: RuntimeServer) -> dict[str, list[int]]:
    """The supervisor's live children by role (an engine maps libtorch; a front does not import torch)."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True,
                                           text=True).stdout.split()]
    roles: dict[str, list[int]] = {"engine": [], "front": []}
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        roles["engine" if "libtorch" in maps else "front"].append(pid)
    return roles


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> RuntimeServer:
    from tests.procs import start_runtime

    keys = tmp_path_factory.mktemp("split") / "keys.yaml"
    keys.write_text('tenants:\n  - name: open\n    keys: ["sk-split-open-0123456789"]\n'
                    '  - name: metered\n    keys: ["sk-split-metered-0123456789"]\n    tokens_per_minute: 120\n')
    srv = start_runtime("--fronts", str(FRONTS), "--api-keys", str(keys))
    srv.headers = {"authorization": "Bearer sk-split-open-0123456789"}
    yield srv
    srv.stop()


def fresh(srv: RuntimeServer, method: str, path: str, **kwargs) -> httpx.Response:
    """One request on a new connection: the kernel hands it to whichever front accepts first."""
    with srv.client() as c:
        return c.request(method, path, **kwargs)


def test_the_fronts_hold_no_torch_and_answer_as_one_process(split, server):
    roles = children(split)
    assert len(roles["engine"]) == 1 and len(roles["front"]) == FRONTS, roles
    cases = [("/v1/embeddings", {"input": TEXTS}), ("/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}),
             ("/v1/embeddings", {"input": TEXTS, "encoding_format": "int8"}), ("/embed", {"inputs": TEXTS}),
             ("/embed", {"inputs": TEXTS, "normalize": False, "truncate": True}), ("/tokenize", {"inputs": "über x"}),
             ("/v1/embeddings", {"input": "x", "model": "nope"}), ("/v1/embeddings", {"input": 5}),
             ("/rerank", {"query": "fox", "texts": TEXTS}), ("/embed_all", {"inputs": "x"})]
    with server.client() as one:
        for path, body in cases:
            want = one.post(path, json=body)
            got = fresh(split, "POST", path, json=body)
            assert_same_answer(got, want, (path, body))
        want = one.get("/v1/models").json()["data"][0]
    # paths with dot segments, sent as they are (an HTTP client library would resolve them first)
    for method, path in (("GET", "/metrics/../v1/models"), ("POST", "/metrics/../v1/embeddings"),
                         ("GET", "/v1/models/./x/probe")):
        body = b'{"input": "x"}' if method == "POST" else b""
        answers = []
        for srv in (server, split):
            with rawhttp.connect(srv.port) as sock:
                sock.sendall(rawhttp.request(method, path, {"Connection": "close", **split.headers}, body))
                answers.append(rawhttp.read_answer(sock))
        assert (answers[1].status, answers[1].body) == (answers[0].status, answers[0].body), (path, answers[1].body)
    got = fresh(split, "GET", "/v1/models").json()["data"][0]
    assert {k: got[k] for k in ("id", "fingerprint", "vector_space", "dimensions", "digest")} == \
        {k: want[k] for k in ("id", "fingerprint", "vector_space", "dimensions", "digest")}


def test_load_reports_the_engines_cold_start_with_the_fronts_first_answer(split, server):
    """/load's `startup` is what the operator's cold-start Event reads when the pod turns Ready: through a
    front it is the engine process's (weights, engine load, warm-up, ready), not the front's, which loads
    no model; the first answer is the front's."""
    want = server.client().get("/load").json()["startup"]
    assert fresh(split, "POST", "/v1/embeddings", json={"input": "x"}).status_code == 200
    got = fresh(split, "GET", "/load").json()["startup"]
    assert {"engine_load", "warmup", "ready"} <= set(got["phases"]), got
    model = got["models"][MODEL]
    assert model["engine_load"] is not None and model["warmup"] is not None, got
    assert got["weights_source"] == want["weights_source"], (got, want)


def test_a_body_on_a_proxied_route_is_bounded_like_any_other(split):
    """GET /v1/models and /metrics pass the gate without its body count; the proxy bounds them itself."""
    answer = fresh(split, "GET", "/v1/models", content=b"x" * 2_000_001)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "payload_too_large", answer.text
    assert fresh(split, "GET", "/health").status_code == 200


def assert_one_quota_per_pod(srv: RuntimeServer, key: str, per_minute: int = 120) -> None:
    """Thirty small requests of a tenant with `per_minute` tokens a minute, each on a new connection: what was
    let through stays within one bucket (and its refill), however the pod's processes share the work."""
    headers = {"authorization": f"Bearer {key}"}
    started, accepted, codes = time.monotonic(), 0, Counter()
    for i in range(30):
        answer = fresh(srv, "POST", "/v1/embeddings", json={"input": f"metered words number {i} here"},
                       headers=headers)
        codes[answer.status_code] += 1
        if answer.status_code == 200:
            accepted += answer.json()["usage"]["total_tokens"]
        else:
            assert answer.status_code == 429 and answer.json()["error"]["code"] == "quota_exceeded", answer.text
            assert int(answer.headers["retry-after"]) >= 1
    refill = (time.monotonic() - started) * per_minute / 60
    assert codes[429] > 0, codes
    assert accepted <= per_minute + refill, (accepted, refill, codes)


def test_a_tenant_quota_is_one_per_pod_across_fronts(split):
    """120 tokens a minute for the pod: were each front to keep its own bucket, two fronts would let
    through about twice that."""
    assert_one_quota_per_pod(split, "sk-split-metered-0123456789")


def test_metrics_are_one_view_of_every_process(split):
    before_inputs = split.metric("embedfleet_inputs_total")
    before = split.metric("embedfleet_request_duration_seconds_count", route="/embed")
    for i in range(12):
        assert fresh(split, "POST", "/embed", json={"inputs": [f"counted {i}", "twice"]}).status_code == 200
    assert split.metric("embedfleet_request_duration_seconds_count", route="/embed") - before == 12
    assert split.metric("embedfleet_inputs_total") - before_inputs == 24
    assert split.metric("embedfleet_requests_in_flight") == 0
    assert split.metric("embedfleet_ready") == 1


def test_a_client_that_leaves_has_its_queued_inputs_dropped_in_the_engine(split):
    """A bulk request far longer than the client waits: once it leaves, the engine's queue empties without
    running the rest (were the cancel lost, the queue would drain only by running all of it)."""
    before = split.metric("embedfleet_inputs_total")
    long_texts = ["a long input of many words to keep the engine busy " * 40] * 512
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=split.url, timeout=1.5,
                                                        headers=split.headers) as c:
        c.post("/embed", json={"inputs": long_texts, "truncate": True})
    deadline = time.monotonic() + 120
    while fresh(split, "GET", "/load").json()["models"][MODEL]["queue_tokens"] > 0:
        assert time.monotonic() < deadline, "the queue did not empty"
        time.sleep(0.1)
    assert split.metric("embedfleet_inputs_total") - before < len(long_texts)


def _load(srv: RuntimeServer, stop: threading.Event, outcomes: list) -> None:
    with srv.client() as c:
        while not stop.is_set():
            try:
                outcomes.append(c.post("/v1/embeddings", json={"input": ["under load", "two"]}).status_code)
            except httpx.TransportError as exc:
                outcomes.append(type(exc).__name__)


def test_a_front_killed_under_load_costs_only_the_requests_it_held(split):
    stop, outcomes, clients = threading.Event(), [], 6
    threads = [threading.Thread(target=_load, args=(split, stop, outcomes)) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2)
    victim = children(split)["front"][0]
    subprocess.run(["kill", "-KILL", str(victim)], check=True)
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join()
    counted = Counter(outcomes)
    assert counted[200] > clients, counted  # the load ran before and after the kill
    assert not [o for o in counted if isinstance(o, int) and o != 200], counted  # no 5xx, no 429
    assert sum(n for o, n in counted.items() if not isinstance(o, int)) <= clients, counted  # one each at most
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        fronts = children(split)["front"]
        if victim not in fronts and len(fronts) == FRONTS:
            break
        time.sleep(0.2)
    assert len(children(split)["front"]) == FRONTS and victim not in children(split)["front"]
    assert "front 0" in split.log() or "front 1" in split.log()
    for _ in range(8):  # fresh connections: both fronts serve, the replacement among them
        assert fresh(split, "POST", "/v1/embeddings", json={"input": "after"}).status_code == 200


def test_an_engine_killed_is_503_at_once_and_the_pod_unready_until_it_is_back(split):
    long_texts = ["a long input of many words to keep the engine busy " * 40] * 256
    answers: list[httpx.Response] = []

    def bulk() -> None:
        with split.client() as c:
            answers.append(c.post("/embed", json={"inputs": long_texts, "truncate": True}))

    t = threading.Thread(target=bulk)
    t.start()
    time.sleep(1.5)
    engine = children(split)["engine"][0]
    subprocess.run(["kill", "-KILL", str(engine)], check=True)
    t.join(timeout=30)
    assert not t.is_alive(), "a request in flight when the engine died hung"
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "engine_unavailable", answers[0].text
    assert int(answers[0].headers["retry-after"]) >= 1
    now = fresh(split, "POST", "/v1/embeddings", json={"input": "x"})
    assert now.status_code == 503 and "retry-after" in now.headers, now.text
    assert "engine process" in now.json()["error"]["message"], now.text
    assert fresh(split, "GET", "/ready").status_code == 503
    split.wait_ready(timeout=180)  # the supervisor started another engine; the fronts reconnected
    assert children(split)["engine"] != [engine]
    assert fresh(split, "POST", "/v1/embeddings", json={"input": "x"}).status_code == 200


def test_sigterm_drains_the_fronts_then_stops_the_engine(tmp_path):
    from tests.procs import start_runtime

    srv = start_runtime("--fronts", "2")
    answers: list[httpx.Response] = []

    def bulk() -> None:
        with srv.client() as c:
            answers.append(c.post("/embed", json={"inputs": ["drained work of a few words"] * 256}))

    t = threading.Thread(target=bulk)
    t.start()
    time.sleep(1.0)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    assert answers and answers[0].status_code == 200 and len(answers[0].json()) == 256
    assert srv.proc.wait(timeout=60) == 0
    assert "drained" in srv.log()
