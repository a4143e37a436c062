"""Reading what a replica reports: its /load document and the headers on its answers."""

from __future__ import annotations

import pytest

from embedfleet.gateway.pick import State
from embedfleet.gateway.upstreams import read_load, server_timing, server_timing_s

LOAD = {"all-MiniLM-L6-v2": {"queue_tokens": 10, "tokens_per_s": 100.0, "expected_wait_s": 0.1},
        "other": {"queue_tokens": 0, "tokens_per_s": 100.0, "expected_wait_s": 2.5}}


@pytest.mark.parametrize(("doc", "deployment", "state", "wait"), [
    ({"ready": True, "status": "ready", "draining": False, "in_flight": 0, "models": LOAD}, "other", State.READY, 2.5),
    ({"ready": True, "draining": False, "in_flight": 0, "models": LOAD}, "all-MiniLM-L6-v2", State.READY, 0.1),
    ({"ready": False, "status": "saturated", "draining": False, "models": LOAD}, "other", State.BUSY, 2.5),
    ({"ready": False, "status": "draining", "draining": True, "models": {}}, "other", State.DRAINING, None),
    ({"ready": False, "draining": True}, "x", State.DRAINING, None),
    ({"ready": False, "status": "loading", "draining": False, "models": {}}, "x", State.DOWN, None),
    ({"ready": False, "status": "failed", "draining": False, "models": {}}, "x", State.DOWN, None),
    ({"ready": False, "draining": False}, "x", State.DOWN, None),
    ({"ready": True, "models": LOAD}, "not-listed", State.READY, 2.5),  # the longest wait of its models
    ([1, 2], "x", State.DOWN, None),
], ids=["ready", "no-status-field", "saturated-is-busy", "draining", "draining-flag", "loading", "failed",
        "not-ready", "unlisted-model", "not-an-object"])
def test_read_load(doc, deployment, state, wait):
    got_state, got_wait, _ = read_load(doc, deployment)
    assert (got_state, got_wait) == (state, wait)


@pytest.mark.parametrize(("header", "seconds"), [
    ("total;dur=12.5", 0.0125), ("db;dur=3, total;dur=40", 0.04), ("total;desc=x;dur=2", 0.002),
    (None, None), ("", None), ("total", None), ("total;dur=abc", None), ("other;dur=1", None),
])
def test_server_timing(header, seconds):
    assert server_timing_s(header) == (pytest.approx(seconds) if seconds is not None else None)


def test_server_timing_parts():
    header = "total;dur=10.5, tokenize;dur=0.125, queue;dur=0.250, inference;desc=\"model\";dur=9.0, other;dur=x"
    assert server_timing(header) == pytest.approx({"total": 0.0105, "tokenize": 0.000125, "queue": 0.00025,
                                                   "inference": 0.009})
    assert server_timing(None) == {} and server_timing("total") == {}
