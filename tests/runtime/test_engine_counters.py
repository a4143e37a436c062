"""The engine's work counters on a real `embedfleet serve`: what the spoke turns into embeddings per busy second
for the hub's cost ranking (operator spoke/throughput.py), so they must count every input the engine ran and
the time it ran them, and nothing that never reached the engine."""

from __future__ import annotations

from tests.procs import RuntimeServer


def test_inputs_and_busy_seconds_move_with_the_work_the_engine_did(server: RuntimeServer) -> None:
    inputs0 = server.metric("embedfleet_inputs_total")
    busy0 = server.metric("embedfleet_engine_busy_seconds_total")
    inference_ms = 0
    with server.client() as c:
        for n in (1, 5, 12):
            answer = c.post("/v1/embeddings", json={"input": [f"sentence {i} of {n}" for i in range(n)]})
            assert answer.status_code == 200, answer.text
            inference_ms += int(answer.headers["x-inference-time"])
        refused = c.post("/v1/embeddings", json={"input": "x", "model": "no-such-model"})
        assert refused.status_code == 404
    inputs = server.metric("embedfleet_inputs_total") - inputs0
    busy = server.metric("embedfleet_engine_busy_seconds_total") - busy0
    assert inputs == 18  # the refused request never reached the engine
    assert busy > 0
    # the same measurement as x-inference-time: each header is rounded to the millisecond, and a batch's
    # time is shared by the requests in it, so the sum is at most the busy seconds plus the rounding
    assert inference_ms / 1000 <= busy + 0.0015 * 3
