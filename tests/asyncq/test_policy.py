"""Pure decisions of the async path: retry schedule, webhook URL policy, signatures, job documents."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.asyncq.status import job_document
from embedfleet.runtime.asyncq.webhooks import (
    WebhookRefused,
    check_scheme,
    check_webhook_url,
    is_internal,
    retry_delay,
    sign,
    verify,
)


@given(st.integers(1, 200), st.floats(0.01, 100))
def test_retry_delay_doubles_and_is_capped(attempt: int, base: float) -> None:
    delay = retry_delay(attempt, base, cap=600)
    assert 0 < delay <= 600
    assert retry_delay(attempt + 1, base, cap=600) >= delay
    if base * 2 ** attempt <= 600:
        assert retry_delay(attempt + 1, base, cap=600) == pytest.approx(2 * delay)


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "192.168.0.9", "172.16.5.5", "169.254.169.254",
                                     "::1", "fc00::1", "::ffff:127.0.0.1", "0.0.0.0", "224.0.0.1"])
def test_internal_addresses(address: str) -> None:
    assert is_internal(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses(address: str) -> None:
    assert not is_internal(address)


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "example.com/hook", "http:///nohost",
                                 "https://user:pw@example.com/", "gopher://127.0.0.1:6379/"])
def test_bad_webhook_urls_are_refused(url: str) -> None:
    with pytest.raises(WebhookRefused):
        check_scheme(url)


def test_loopback_webhook_needs_opt_in() -> None:
    with pytest.raises(WebhookRefused, match="webhook-allow-private"):
        asyncio.run(check_webhook_url("http://localhost:9/hook", allow_private=False))
    assert asyncio.run(check_webhook_url("http://127.0.0.1:9/hook", allow_private=True)) == "http://127.0.0.1:9/hook"


@given(st.binary(max_size=300), st.integers(1_600_000_000, 2_000_000_000))
def test_signature_is_hmac_of_timestamp_dot_body(body: bytes, ts: int) -> None:
    secret = b"k3y"
    expected = hmac.new(secret, f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    assert sign(secret, str(ts), body) == "v1=" + expected
    assert verify(secret, str(ts), body, "v1=" + expected, now=ts + 10)
    assert not verify(secret, str(ts), body + b"x", "v1=" + expected, now=ts)
    assert not verify(secret, str(ts), body, "v1=" + expected, now=ts + 3600)  # replayed later: refused
    assert not verify(b"other", str(ts), body, "v1=" + expected, now=ts)


def test_job_document_splices_result_and_reports_failure() -> None:
    result = orjson.dumps({"object": "list", "data": [{"index": 0, "embedding": [0.5, 0.25]}]})
    done = orjson.loads(job_document("abc", {"status": b"succeeded", "created_at": b"10.5", "attempts": b"1",
                                             "result": result, "webhook_url": b"http://x", "webhook_status":
                                             b"delivered", "webhook_attempts": b"3"}))
    assert done["status"] == "succeeded" and done["result"]["data"][0]["embedding"] == [0.5, 0.25]
    assert done["webhook"] == {"status": "delivered", "attempts": 3} and done["created_at"] == 10.5
    failed = orjson.loads(job_document("abc", {"status": b"failed", "error": b"too long"}))
    assert failed["error"]["message"] == "too long" and "result" not in failed
