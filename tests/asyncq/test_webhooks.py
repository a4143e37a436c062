"""Webhooks to a real receiver on 127.0.0.1: signed, retried with backoff, dead-lettered, replayed."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pytest

from tests.asyncq.procs import KEYS, WebhookReceiver, jobs_cli, start_redis, wait_for
from tests.procs import start_runtime

SECRET = "whsec-test-only"
outcomes: dict[str, int] = {}  # path -> status the receiver answers from now on


def respond(path: str, nth: int) -> int:
    if path == "/flaky":
        return 500 if nth <= 2 else 200
    return outcomes.get(path, 200)


@pytest.fixture(scope="module")
def stack():
    receiver = WebhookReceiver(respond)
    receiver.start()
    redis_server = start_redis(appendonly=True)
    srv = start_runtime("--redis-url", redis_server.url, "--webhook-secret", SECRET, "--webhook-allow-private",
                        "--webhook-backoff", "0.3", "--webhook-max-attempts", "3", env={"EMBEDFLEET_LOG_LEVEL": "info"})
    yield srv, redis_server, receiver
    srv.stop()
    redis_server.stop()
    receiver.stop()


def verify(headers: dict[str, str], body: bytes) -> bool:
    """The receiver-side check from docs/async.md, written out independently of the server's code."""
    timestamp = headers["x-embedfleet-timestamp"]
    expected = "v1=" + hmac.new(SECRET.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, headers["x-embedfleet-signature"]) and abs(time.time() - int(timestamp)) < 300


def test_third_delivery_succeeds_and_its_signature_verifies(stack) -> None:
    srv, _, receiver = stack
    with srv.client() as c:
        job = c.post("/async/v1/embeddings", json={"input": ["signed", "delivery"],
                                                   "webhook_url": f"{receiver.url}/flaky"}).json()
        wait_for(lambda: len(receiver.to("/flaky")) >= 3, 60, "three deliveries")
        wait_for(lambda: c.get(f"/async/jobs/{job['id']}").json().get("webhook", {}).get("status") == "delivered",
                 30, "the job to record the delivery")
        doc = c.get(f"/async/jobs/{job['id']}").json()
    deliveries = receiver.to("/flaky")
    assert len(deliveries) == 3  # no fourth: the 200 ended it
    assert [d.headers["x-embedfleet-attempt"] for d in deliveries] == ["1", "2", "3"]
    assert all(verify(d.headers, d.body) for d in deliveries)
    assert not verify(deliveries[-1].headers, deliveries[-1].body.replace(b"\"succeeded\"", b"\"failed\""))
    payload = json.loads(deliveries[-1].body)
    assert deliveries[-1].headers["x-embedfleet-job-id"] == job["id"] == payload["id"]
    assert payload["status"] == "succeeded" and len(payload["result"]["data"]) == 2
    assert doc["webhook"] == {"status": "delivered", "attempts": 3}


def test_always_failing_receiver_dead_letters_then_replay_delivers(stack) -> None:
    srv, redis_server, receiver = stack
    outcomes["/down"] = 503
    with srv.client() as c:
        job = c.post("/async/v1/embeddings", json={"input": "nobody listens",
                                                   "webhook_url": f"{receiver.url}/down"}).json()
        wait_for(lambda: redis_server.client().xlen(KEYS.dead_letters) >= 1, 60, "a dead letter")
        assert c.get(f"/async/jobs/{job['id']}").json()["webhook"] == {"status": "dead", "attempts": 3}
    assert len(receiver.to("/down")) == 3

    listed = jobs_cli(redis_server.url, "dlq", "list")
    assert listed.returncode == 0, listed.stderr
    letters = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [x["id"] for x in letters] == [job["id"]]
    assert letters[0]["webhook_url"] == f"{receiver.url}/down" and "503" in letters[0]["error"]

    outcomes["/down"] = 200  # the receiver is fixed; the operator replays
    replayed = jobs_cli(redis_server.url, "dlq", "replay", job["id"])
    assert replayed.returncode == 0 and "replayed 1" in replayed.stdout, replayed.stderr
    wait_for(lambda: len(receiver.to("/down")) == 4, 30, "the replayed delivery")
    last = receiver.to("/down")[-1]
    assert verify(last.headers, last.body) and json.loads(last.body)["status"] == "succeeded"
    with srv.client() as c:
        wait_for(lambda: c.get(f"/async/jobs/{job['id']}").json()["webhook"]["status"] == "delivered", 30,
                 "the job to record the replayed delivery")
    assert redis_server.client().xlen(KEYS.dead_letters) == 0
    assert jobs_cli(redis_server.url, "dlq", "list").stdout == ""
    stats = json.loads(jobs_cli(redis_server.url, "stats").stdout)
    assert stats["dead_letters"] == 0 and stats["queue_depth"] == 0 and stats["succeeded"] >= 1
