"""Every operation of the runtime's OpenAPI document, fuzzed over a real socket with a fixed seed:
no 5xx, answers as documented, every refusal in the error shape (harness.py says what is checked).

A failure lists each failing request as it went out; copy it into test_regressions.py once fixed.
"""

from __future__ import annotations

import pytest

from tests.fuzz.harness import fuzz

pytestmark = pytest.mark.timeout(900)


def test_fresh_runtime(fresh_runtime):
    report = fuzz(fresh_runtime.url)
    print(report.summary())  # shown by `pytest -rA`: the same seed sends the same requests, run after run
    assert len(report.operations) >= 19 and set(report.statuses) == set(report.operations), report.summary()
    assert not report.failures, report.summary()


def test_runtime_after_a_storm(stormed_runtime):
    runtime, storm = stormed_runtime
    assert not storm.server_errors, storm
    assert storm.statuses.get(200), storm  # the storm did reach the engine
    report = fuzz(runtime.url)
    print(f"{storm}\n{report.summary()}")
    assert not report.failures, f"{storm}\n{report.summary()}"
